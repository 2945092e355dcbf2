"""Every model family on a tiny random checkpoint matches transformers on the same weights.

For each architecture (tests/fixtures/tiny_families.py, and Llama with `hidden_act: gelu`)
and the phase-1 families with their sliding windows on (WINDOWED: Starcoder2, Phi-3, Qwen2,
Qwen3, SmolLM3, EXAONE 4's hybrid; windows of 8 on a 40-token prompt, as in the hybrid
families Gemma 2/3 and Cohere 2), at page sizes 1 and 16 over a fragmented allocator: the
logits of a one-shot prefill and of a chunked one (three chunks, each crossing a window)
match transformers' forward, so does a prefill over a warm prefix (another request's cached
pages, longer than the window), and greedy decoding gives transformers.generate's tokens
and logits. Then the length-dependent RoPE types: Phi-3's longrope with a prompt past
`original_max_position_embeddings` (long factors) and one that crosses it while decoding,
and dynamic NTK past `max_position_embeddings`, both against transformers' generate with its
KV cache, whose per-step rule sglite follows (sglite.layers.rotary_embedding).
"""

from __future__ import annotations

import pytest
import torch

from fixtures.model_driver import Driver, fragment_allocator
from fixtures.tiny_families import FAMILIES, GEMMA_WINDOW

W = GEMMA_WINDOW  # every window below is shorter than PROMPT
SLIDING, FULL = "sliding_attention", "full_attention"
# the phase-1 families with their sliding windows switched on
WINDOWED = {
    "starcoder2_swa": ("starcoder2", {"config": {"sliding_window": W}}),
    "phi3_swa": ("phi3", {"config": {"sliding_window": W}}),
    "qwen2_swa": ("qwen2", dict(sliding_window=W, max_window_layers=1, num_hidden_layers=3)),
    "qwen3_swa": ("qwen3", dict(sliding_window=W, max_window_layers=1, num_hidden_layers=3)),
    # SmolLM3 windows its NoPE layer (no_rope_layers [1, 0, 1]: layer 1)
    "smollm3_swa": ("smollm3", {"config": {"use_sliding_window": True, "sliding_window": W}}),
    # EXAONE 4's hybrid: the windowed layers rotate, the global one is NoPE
    "exaone4_hybrid": (
        "exaone4",
        {"config": {"sliding_window": W, "layer_types": [SLIDING, SLIDING, FULL]}},
    ),
}
CASES = {name: (name, {}) for name in FAMILIES} | WINDOWED
CASES["llama_gelu"] = ("llama", {"config": {"hidden_act": "gelu"}})
# the families whose own tiny config has windows (tests/fixtures/tiny_families.py)
HYBRID = ("gemma2", "gemma3", "cohere2")
PAGE_SIZES = (1, 16)
ATOL = 1e-4
CHUNKS = (13, 29)  # the prompt's chunk boundaries in the chunked prefill
DECODE_STEPS = 12


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


PROMPT = _prompt(40)  # crosses two page boundaries at page size 16, and every window


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            arch, opts = CASES[name]
            path = tiny_model_dir(arch, **opts)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            model.generation_config.eos_token_id = None  # decode the full length
            cache[name] = model
        return cache[name]

    return get


@pytest.fixture(scope="module")
def hf_ref(hf_model):
    """transformers' reference for PROMPT, once per case: (prompt logits, generate's tokens,
    generate's logits)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf = hf_model(name)
            cache[name] = (_hf_logits(hf, PROMPT), *_hf_generate(hf, PROMPT, DECODE_STEPS))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    from sglite.model_executor.model_runner import ModelRunner

    cache = {}

    def get(name: str, page_size: int):
        if (name, page_size) not in cache:
            arch, opts = CASES[name]
            r = ModelRunner(
                tiny_model_dir(arch, **opts),
                device="cpu",
                page_size=page_size,
                max_total_tokens=1024,
                max_running_requests=8,
            )
            fragment_allocator(r.allocator, seed=page_size)
            cache[name, page_size] = r
        return cache[name, page_size]

    return get


@torch.no_grad()
def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def _hf_generate(hf, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate with its KV cache: the new tokens and their logits."""
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), [s[0].float() for s in out.logits]


@torch.no_grad()
def _hf_cached_steps(hf, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' forward stepping its own KV cache, token by token (what generate does,
    minus Phi-3's recompute of the whole cache when the length first passes the original)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(steps):
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, logits


def _greedy(driver: Driver, prompt: list[int], steps: int) -> tuple[list[int], list]:
    seq = driver.new_seq()
    logits = [driver.extend([seq], [prompt])[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(driver.decode([seq], [tokens[-1]])[0])
        tokens.append(int(logits[-1].argmax()))
    driver.release(seq)
    return tokens, logits


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_one_shot_and_chunked_match_transformers(name, page_size, runner, hf_ref):
    driver, ref = Driver(runner(name, page_size)), hf_ref(name)[0]
    assert ref.std() > 0.1, "degenerate model: the test would not catch much"
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    driver.release(seq)

    seq, start, chunks = driver.new_seq(), 0, []
    for end in (*CHUNKS, len(PROMPT)):
        chunks.append(driver.extend([seq], [PROMPT[start:end]], return_all_logits=True))
        start = end
    torch.testing.assert_close(torch.cat(chunks), ref, atol=ATOL, rtol=0)
    driver.release(seq)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_over_a_warm_prefix_matches_transformers(name, page_size, runner, hf_ref):
    driver, ref = Driver(runner(name, page_size)), hf_ref(name)[0]
    cold = driver.new_seq()
    driver.extend([cold], [PROMPT])
    half = 16 if page_size == 16 else 19  # cached prefixes are whole pages
    warm = driver.new_seq(prefix=cold, prefix_len=half)
    logits = driver.extend([warm], [PROMPT[half:]], return_all_logits=True)
    assert warm.slots[:half] == cold.slots[:half]
    torch.testing.assert_close(logits, ref[half:], atol=ATOL, rtol=0)
    driver.release(warm)
    driver.release(cold)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_decode_matches_transformers_generate(name, page_size, runner, hf_ref):
    _, expected, ref_logits = hf_ref(name)
    tokens, logits = _greedy(Driver(runner(name, page_size)), PROMPT, DECODE_STEPS)
    for step, (got, want) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"step {step}")
    assert tokens == expected


def test_longrope_past_the_original_length_uses_the_long_factors(runner, hf_model):
    """Phi-3's original_max_position_embeddings is 64 in the tiny config; this prompt is 80."""
    prompt = _prompt(80, 3)
    hf, driver = hf_model("phi3"), Driver(runner("phi3", 1))
    seq = driver.new_seq()
    logits = driver.extend([seq], [prompt], return_all_logits=True)
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
    driver.release(seq)
    expected, ref_logits = _hf_generate(hf, prompt, 8)
    tokens, logits = _greedy(driver, prompt, 8)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=ATOL, rtol=0)
    assert tokens == expected


def test_longrope_crossing_while_decoding_keeps_the_cached_keys(runner, hf_model):
    """A request that passes the original length mid-decode: its new tokens rotate with the
    long factors, its cached keys keep the short ones (transformers' forward stepping its
    cache does the same; its generate instead recomputes the whole cache at the crossing,
    which a server sharing cached prefixes does not: sglite.layers.rotary_embedding)."""
    prompt = _prompt(56, 3)
    expected, ref_logits = _hf_cached_steps(hf_model("phi3"), prompt, 16)
    tokens, logits = _greedy(Driver(runner("phi3", 1)), prompt, 16)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=ATOL, rtol=0)
    assert tokens == expected


@pytest.mark.parametrize("name", sorted([*WINDOWED, *HYBRID]))
def test_windowed_cases_attend_through_windows_shorter_than_the_prompt(name, runner):
    windows = [layer.self_attn.attn.sliding_window for layer in runner(name, 1).model.model.layers]
    assert W in windows and set(windows) <= {W, None} and W < len(PROMPT)


def test_the_window_changes_transformers_logits(hf_ref):
    """The window bites on PROMPT: Starcoder2's logits with and without it (same weights)
    agree up to the window and differ past it, so a model ignoring it fails the tests above."""
    full, windowed = hf_ref("starcoder2")[0], hf_ref("starcoder2_swa")[0]
    torch.testing.assert_close(windowed[:W], full[:W], atol=1e-5, rtol=0)
    assert (windowed[W:] - full[W:]).abs().max() > 0.1


def test_longrope_factor_sets_differ_enough_to_be_caught(runner):
    """The short and long rows of the table differ: picking the wrong set would show."""
    rope = runner("phi3", 1).model.model.rotary_emb
    short, long = rope.cos_sin.split(rope.max_position)
    assert (short[100] - long[100]).abs().max() > 0.1


def test_dynamic_ntk_past_the_model_length_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from sglite.model_executor.model_runner import ModelRunner

    opts = dict(
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        config={"max_position_embeddings": 64},
    )
    path = tiny_model_dir("llama", **opts)
    prompt = _prompt(90, 4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    driver = Driver(ModelRunner(path, device="cpu", context_length=256, max_total_tokens=512))
    seq = driver.new_seq()
    logits = driver.extend([seq], [prompt], return_all_logits=True)
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=ATOL, rtol=0)
    driver.release(seq)
    # a fresh transformers model: its dynamic rope keeps the longest length it has seen
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    expected, ref_logits = _hf_generate(hf, prompt, 8)
    tokens, logits = _greedy(driver, prompt, 8)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), atol=ATOL, rtol=0)
    assert tokens == expected


def test_engine_logprobs_and_structured_output_on_gemma(core, tiny_model_dir, hf_model):
    """A new family through the whole engine (scheduler, tree core, detokenizer): Gemma's
    log-probs equal transformers' log-softmax, and a JSON schema and a regex constrain it."""
    import json

    import jsonschema

    import sglite

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["city", "n"],
    }
    prompt, steps = PROMPT[:24], 6
    with sglite.Engine(
        model_path=str(tiny_model_dir("gemma")),
        tree_core=core.name,
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        greedy = {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True}
        out = engine.generate(
            input_ids=prompt,
            sampling_params=greedy,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        )
        structured = engine.generate(
            ["The river town", "Fishermen"],
            {
                "max_new_tokens": 60,
                "temperature": 0.9,
                "seed": 3,
                "json_schema": json.dumps(schema),
            },
        )
        regex = engine.generate("x", {"regex": "(town|bread) at 7", "temperature": 0})
    tokens, ref_logits = _hf_generate(hf_model("gemma"), prompt, steps)
    assert out["output_ids"] == tokens
    meta = out["meta_info"]
    for (logprob, token, _), logits in zip(meta["output_token_logprobs"], ref_logits):
        assert abs(logprob - logits.log_softmax(-1)[token].item()) < 5e-4
    ref_in = _hf_logits(hf_model("gemma"), prompt).log_softmax(-1)
    assert meta["input_token_logprobs"][0][0] is None
    for i, (logprob, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert token == prompt[i] and abs(logprob - ref_in[i - 1, token].item()) < 5e-4
    assert [t for _, t, _ in meta["output_top_logprobs"][0]] == ref_logits[0].topk(
        2
    ).indices.tolist()
    for item in structured:
        assert item["meta_info"]["finish_reason"]["type"] == "stop", item
        jsonschema.validate(json.loads(item["text"]), schema)
    assert regex["text"] in ("town at 7", "bread at 7")


# Gemma's template shape: user/model turns, and no system role (the template raises on one)
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_gemma_chat_without_a_system_role_is_a_400_not_a_500(tiny_model_dir, tmp_path):
    import shutil

    import httpx
    from transformers import AutoTokenizer

    from fixtures.serving import start_server

    model = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir("gemma"), model)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = GEMMA_STYLE_TEMPLATE
    tok.save_pretrained(str(model))
    args = ["--model-path", str(model), "--max-total-tokens", "2048", "--served-model-name", "g"]
    server = start_server(args, tmp_path / "server.log", fake=False)
    try:
        chat = server.url + "/v1/chat/completions"
        user = {"role": "user", "content": "Where is the river?"}
        body = {"model": "g", "max_tokens": 4, "temperature": 0}
        ok = httpx.post(chat, json={**body, "messages": [user]}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        system = {"role": "system", "content": "Be brief."}
        bad = httpx.post(chat, json={**body, "messages": [system, user]}, timeout=60)
        assert bad.status_code == 400, bad.text
        message = bad.json()["error"]["message"]
        assert "chat template rejected" in message and "System role not supported" in message
    finally:
        assert server.stop() == 0, server.log()
