"""End to end: the real server (subprocess, free port) on a tiny model and on SmolLM2.

Native /generate (plain and SSE), the official `openai` client (completions and chat,
streaming and not), greedy outputs equal to transformers', 16 concurrent streaming clients,
KV freed after a client disconnects mid-stream, and bad input answered with a 400 while the
server keeps serving. One server per model for the whole module; outputs are kept short.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from fixtures.serving import descendants, start_server

GREEDY = {"temperature": 0, "ignore_eos": True}


def _server(model_dir, tmp_path_factory, *extra: str):
    log = tmp_path_factory.mktemp("log") / "server.log"
    return start_server(
        [
            "--model-path",
            str(model_dir),
            "--max-total-tokens",
            "8192",
            "--served-model-name",
            "m",
            *extra,
        ],
        log,
        fake=False,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    srv = _server(tiny_model_dir("llama"), tmp_path_factory, "--enable-metrics")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def tiny_one_slot(tiny_model_dir, tmp_path_factory):
    """One running request at a time: a second one waits until the first has left."""
    srv = _server(tiny_model_dir("llama"), tmp_path_factory, "--max-running-requests", "1")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def smol(smollm2_dir, tmp_path_factory):
    srv = _server(smollm2_dir, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def hf_greedy(model_dir, prompt: str, steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def generate(srv, text: str, **sp) -> dict:
    r = httpx.post(srv.url + "/generate", json={"text": text, "sampling_params": sp}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_generate(srv, text: str, **sp) -> list[dict]:
    with httpx.stream(
        "POST",
        srv.url + "/generate",
        timeout=120,
        json={"text": text, "sampling_params": sp, "stream": True},
    ) as r:
        return parse_sse(r.iter_lines())


def parse_sse(lines) -> list[dict]:
    """The data chunks of a finished /generate stream, checked to be well formed: each one
    extends the previous one's cumulative output, only the last one has a finish reason."""
    lines = [line for line in lines if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks and all("error" not in c for c in chunks), chunks
    prev = {"text": "", "output_ids": []}
    for c in chunks:
        assert c["text"].startswith(prev["text"]), (prev, c)
        assert c["output_ids"][: len(prev["output_ids"])] == prev["output_ids"], (prev, c)
        assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
        assert c["meta_info"]["id"] == chunks[0]["meta_info"]["id"]
        prev = c
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    return chunks


def server_info(srv) -> dict:
    return httpx.get(srv.url + "/get_server_info", timeout=30).json()


# ---------------------------------------------------------------------- tiny model
PROMPTS = [
    "The river town woke slowly",
    "In the library at the top of the hill",
    "Every good system, she wrote",
    "Fishermen pulled their boats",
]


def test_generate_greedy_matches_transformers(tiny, tiny_model_dir, tokenizer):
    out = generate(tiny, PROMPTS[0], max_new_tokens=8, **GREEDY)
    assert out["output_ids"] == hf_greedy(tiny_model_dir("llama"), PROMPTS[0], 8)
    assert out["text"] == tokenizer.decode(out["output_ids"])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPTS[0]))
    assert meta["completion_tokens"] == 8 and meta["e2e_latency"] > 0
    again = generate(tiny, PROMPTS[0], max_new_tokens=8, **GREEDY)
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0  # the prompt is in the radix cache now


def test_generate_stream_matches_non_stream(tiny):
    """Content, not chunking: a loaded server may send all tokens in one chunk."""
    full = generate(tiny, PROMPTS[1], max_new_tokens=10, **GREEDY)
    chunks = stream_generate(tiny, PROMPTS[1], max_new_tokens=10, **GREEDY)
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert chunks[-1]["meta_info"]["prompt_tokens"] == full["meta_info"]["prompt_tokens"]


def test_openai_completions(tiny):
    ref = generate(tiny, PROMPTS[2], max_new_tokens=6, **GREEDY)
    client = openai.OpenAI(base_url=tiny.url + "/v1", api_key="none")
    r = client.completions.create(
        model="m", prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    stream = client.completions.create(
        model="m",
        prompt=PROMPTS[2],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == 6
    models = client.models.list()
    assert models.data[0].id == "m"


def test_concurrent_streaming_clients(tiny):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    solo = {p: generate(tiny, p, max_new_tokens=12, **GREEDY)["text"] for p in prompts[:4]}

    async def one(c: httpx.AsyncClient, text: str) -> dict:
        body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
        last, done = None, False
        async with c.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    last = json.loads(line[6:])
        assert done
        return last

    async def main() -> list[dict]:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    outs = asyncio.run(main())
    for p, out in zip(prompts, outs):
        assert out["meta_info"]["completion_tokens"] == 12
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        if p in solo:
            assert out["text"] == solo[p]  # batching does not change a greedy answer
    assert len({o["meta_info"]["id"] for o in outs}) == 16


def test_disconnect_mid_stream_frees_kv(tiny):
    body = {
        "text": PROMPTS[3],
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, **GREEDY},
    }
    with httpx.stream("POST", tiny.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
        stats = server_info(tiny)
        assert stats["num_running_reqs"] == 1 and stats["kv_used_tokens"] > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = server_info(tiny)
        if stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0, stats


def test_disconnect_aborts_only_its_own_request(tiny_one_slot):
    """A client that goes away aborts its request by exact id (SGLang's /abort_request
    matches a prefix): "ab" runs to the end after "a" disconnects. With one running slot
    "ab" is still queued behind "a" when a's abort reaches the scheduler, so an abort by
    prefix would always hit it."""
    srv = tiny_one_slot
    ref = generate(srv, PROMPTS[2], max_new_tokens=8, **GREEDY)

    def body(rid: str, n: int) -> dict:
        sp = {"max_new_tokens": n, **GREEDY}
        return {"rid": rid, "text": PROMPTS[2], "stream": True, "sampling_params": sp}

    with (
        httpx.Client(base_url=srv.url, timeout=120) as ca,
        httpx.Client(base_url=srv.url, timeout=120) as cab,
    ):
        with ca.stream("POST", "/generate", json=body("a", 480)) as ra:
            a_lines = ra.iter_lines()  # kept: closing the iterator would close the connection
            first = json.loads(next(x for x in a_lines if x.startswith("data: {"))[6:])
            assert first["meta_info"]["finish_reason"] is None  # "a" is running
            # Its headers are back, so "ab" was sent to the scheduler ahead of a's abort.
            rab = cab.send(cab.build_request("POST", "/generate", json=body("ab", 8)), stream=True)
        # Leaving the block closed a's connection mid-stream: the server aborts "a".
        try:
            chunks = parse_sse(rab.iter_lines())
        finally:
            rab.close()
    last = chunks[-1]
    assert last["meta_info"]["id"] == "ab"
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert last["output_ids"] == ref["output_ids"] and last["text"] == ref["text"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"text": "word " * 600}, "text"),
        ({"text": "Hi", "sampling_params": {"max_new_tokens": 600}}, "max_new_tokens"),
        ({"text": "Hi", "sampling_params": {"top_k": -5}}, "top_k"),
        ({"input_ids": [10**7]}, "input_ids"),
        ({"text": "Hi", "input_ids": [1]}, "input_ids"),
    ],
)
def test_bad_input_400_and_still_serving(tiny, body, field):
    r = httpx.post(tiny.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and field in r.json()["error"]["message"]
    assert generate(tiny, "Hi", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_chat_without_template_is_400(tiny):
    r = httpx.post(
        tiny.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_server_info_and_metrics(tiny):
    info = server_info(tiny)
    assert info["tree_core"]["backend"] in ("python", "rust")
    assert "cache_hit_rate" in info and info["internal_states"][0]["kv_total_tokens"] > 0
    assert httpx.get(tiny.url + "/health_generate", timeout=60).status_code == 200
    metrics = httpx.get(tiny.url + "/metrics", timeout=30).text
    assert 'sglang:time_to_first_token_seconds_count{model_name="m"}' in metrics
    assert "sglang:generation_tokens_total" in metrics


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("libtorch" in line for line in maps)


def test_only_the_scheduler_loads_torch(tiny):
    """The main process and the detokenizer never load torch (~0.4 GB of RSS each), after
    serving requests too; the scheduler does."""
    assert httpx.post(tiny.url + "/generate", json={"text": "hi"}, timeout=60).status_code == 200
    children = descendants(tiny.proc.pid)
    with_torch = [pid for pid in [tiny.proc.pid, *children] if _maps_torch(pid)]
    assert len(children) == 2 and len(with_torch) == 1, (children, with_torch)
    assert tiny.proc.pid not in with_torch


# ---------------------------------------------------------------------- SmolLM2
def test_smollm2_chat_knows_paris(smol):
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=16, temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


def test_smollm2_greedy_matches_transformers(smol, smollm2_dir):
    prompt = "The capital of France is"
    out = generate(smol, prompt, max_new_tokens=6, **GREEDY)
    assert out["output_ids"] == hf_greedy(smollm2_dir, prompt, 6)


def test_smollm2_stop_string_and_n(smol):
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="none")
    kw = dict(model="m", prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"])
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].matched_stop == " 7"
    assert r.choices[0].text == " 5, 6,"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == r.choices[0].text  # no part of the stop string was streamed
    r = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=4, temperature=1.0, n=2, seed=1
    )
    assert [c.index for c in r.choices] == [0, 1]
