"""Log-probs through the real server on a tiny model: native /generate (SGLang's meta_info
lists) and the `openai` client (completions with echo, chat with top_logprobs, streamed and
not), checked against transformers' log-softmax, with a warm prefix cache."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from fixtures.serving import start_server

TOL = 1e-3
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        ["--model-path", str(tiny_chat_model_dir), "--max-total-tokens", "4096",
         "--served-model-name", "m", "--chunked-prefill-size", "16"],
        log,
        fake=False,
        timeout=300,
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def hf(tiny_chat_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the distribution of the token after ids[:p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_generate_meta_info_matches_transformers(server, hf):
    model, tok = hf
    prompt_ids = tok.encode(PROMPT)
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 7],
        "return_text_in_logprobs": True,
    }
    for _ in range(2):  # the second time the prompt is cached: same answer
        out = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        meta = out["meta_info"]
        ids = prompt_ids + out["output_ids"]
        ref = ref_logprobs(model, ids)
        inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
        assert [t[1] for t in inp] == prompt_ids[3:]
        assert [t[1] for t in outp] == out["output_ids"]
        for pos, (lp, tid, text) in zip(range(3, len(ids)), inp + outp):
            assert abs(lp - ref[pos - 1, tid].item()) < TOL
            plain = tok.decode([tid])  # a partial character shows its bytes instead
            assert text == plain if "\ufffd" not in plain else text.startswith("bytes:\\x")
        for pos, top in zip(
            range(3, len(ids)), meta["input_top_logprobs"] + meta["output_top_logprobs"]
        ):
            assert [t[1] for t in top] == ref[pos - 1].topk(2).indices.tolist()
        selected = meta["input_token_ids_logprobs"] + meta["output_token_ids_logprobs"]
        assert len(selected) == len(ids) - 3
        for pos, sel in zip(range(3, len(ids)), selected):
            assert [t[1] for t in sel] == [5, 7]
            assert abs(sel[0][0] - ref[pos - 1, 5].item()) < TOL
            assert abs(sel[1][0] - ref[pos - 1, 7].item()) < TOL


def test_generate_without_return_logprob_has_no_lists(server):
    out = httpx.post(
        f"{server.url}/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    ).json()
    assert "output_token_logprobs" not in out["meta_info"]


def test_completions_echo_logprobs(server, hf):
    model, tok = hf
    prompt_ids = tok.encode(PROMPT)
    c = client(server)
    first = None
    for _ in range(2):  # cold, then warm cache
        resp = c.completions.create(
            model="m", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=3
        )
        choice = resp.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(PROMPT)
        n = len(prompt_ids) + 4
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        ref = ref_logprobs(model, prompt_ids)
        for p in range(1, len(prompt_ids)):
            assert abs(lp.token_logprobs[p] - ref[p - 1, prompt_ids[p]].item()) < TOL
            assert len(lp.top_logprobs[p]) <= 3
        # greedy: each output token is its position's best
        for p in range(len(prompt_ids), n):
            assert abs(lp.token_logprobs[p] - max(lp.top_logprobs[p].values())) < TOL
        if first is None:
            first = lp.token_logprobs
        else:
            assert lp.token_logprobs[1:] == pytest.approx(first[1:], abs=TOL)


def test_completions_scoring_with_max_tokens_zero(server, hf):
    """What evaluation harnesses send to score a continuation: echo, logprobs, no output."""
    model, tok = hf
    resp = client(server).completions.create(
        model="m", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = resp.choices[0].logprobs
    prompt_ids = tok.encode(PROMPT)
    assert resp.choices[0].text == PROMPT
    assert len(lp.token_logprobs) == len(prompt_ids)
    ref = ref_logprobs(model, prompt_ids)
    total = sum(lp.token_logprobs[1:])
    expected = sum(ref[p - 1, prompt_ids[p]].item() for p in range(1, len(prompt_ids)))
    assert abs(total - expected) < 1e-2


@pytest.mark.parametrize("echo", [False, True])
def test_completions_stream_logprobs_equal_non_stream(server, echo):
    c = client(server)
    kw = dict(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=echo)
    whole = c.completions.create(**kw).choices[0]
    tokens, values, text = [], [], ""
    for chunk in c.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert text == whole.text and text.startswith(PROMPT) == echo
    assert tokens == whole.logprobs.tokens
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


def test_chat_logprobs(server):
    c = client(server)
    kw = dict(
        model="m",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    resp = c.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=TOL)  # greedy
        if not entry.token.startswith("bytes:"):  # else a partial character: its bytes
            assert entry.bytes == list(entry.token.encode())
    streamed = []
    for chunk in c.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    plain = c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/generate", {"return_logprob": True, "logprob_start_len": 10_000}, "logprob_start_len"),
        ("/generate", {"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ("/generate", {"return_logprob": True, "token_ids_logprob": [10**7]}, "token_ids_logprob"),
    ],
)
def test_bad_logprob_fields_are_400(server, route, body, param):
    if route == "/generate":
        body = {"text": "hi", **body}
    elif "chat" in route:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"model": "m", "prompt": "hi", **body}
    r = httpx.post(f"{server.url}{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
