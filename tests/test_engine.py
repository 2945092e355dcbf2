"""The offline Engine: generate / batch generate / streaming return /generate's dicts, bad
input raises ValueError, and shutdown leaves no processes and no IPC files behind.

The first group runs on the model-free fake scheduler (the Engine's own mechanics); the
second on the real scheduler and a tiny model, against transformers' greedy decoding."""

from __future__ import annotations

import os
import time

import pytest
import torch

import sglite
from fixtures.serving import build_tiny_tokenizer, descendants, run_fake_scheduler


def _wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = pids & set(descendants(os.getpid()))
        if not alive:
            return set()
        time.sleep(0.1)
    return alive


# ---------------------------------------------------------------------- fake scheduler
@pytest.fixture(scope="module")
def fake_engine(tmp_path_factory):
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    before = set(descendants(os.getpid()))
    engine = sglite.Engine(
        model_path=str(tok),
        context_length=256,
        scheduler_entry=run_fake_scheduler,
        log_level="warning",
    )
    yield engine
    children = set(descendants(os.getpid())) - before
    engine.shutdown()
    assert not _wait_gone(children), "Engine.shutdown left processes behind"


def test_generate_returns_generate_dicts(fake_engine):
    out = fake_engine.generate("Hello world", {"max_new_tokens": 4, "temperature": 0})
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["text"] == "Hello world"[: len(out["text"])]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert out["meta_info"]["completion_tokens"] == 4


def test_batch_generate(fake_engine):
    outs = fake_engine.generate(["Hello", "東京"], {"max_new_tokens": 3})
    assert isinstance(outs, list) and [o["text"][:1] for o in outs] == ["H", "東"]
    outs = fake_engine.generate(
        input_ids=[[5, 6], [7]], sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 3}]
    )
    assert [o["output_ids"] for o in outs] == [[5, 6], [7, 7, 7]]


def test_stream(fake_engine):
    chunks = list(fake_engine.generate("Emoji 😀 here", {"max_new_tokens": 6}, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stream_stopped_early_aborts(fake_engine):
    it = fake_engine.generate_stream("Hello", {"max_new_tokens": 200})
    next(it)
    it.close()
    deadline = time.monotonic() + 5
    while fake_engine.tm.states and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not fake_engine.tm.states


def test_bad_input_raises_value_error(fake_engine):
    with pytest.raises(ValueError, match="top_p"):
        fake_engine.generate("Hi", {"top_p": 7})
    with pytest.raises(ValueError, match="context length"):
        fake_engine.generate("Hi", {"max_new_tokens": 10_000})
    with pytest.raises(ValueError, match="text and input_ids"):
        fake_engine.generate()
    with pytest.raises(TypeError, match="no_such_flag"):
        sglite.Engine(model_path="x", no_such_flag=1)


# ---------------------------------------------------------------------- real scheduler
def _hf_greedy(model_dir, prompt_ids: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt_ids) :]


def test_engine_on_tiny_model_matches_transformers(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    before = set(descendants(os.getpid()))
    with sglite.Engine(
        model_path=str(model_dir), max_total_tokens=2048, log_level="warning"
    ) as engine:
        children = set(descendants(os.getpid())) - before
        assert len(children) >= 2
        ipc_dir = engine._backend.ipc.dir
        greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        prompts = ["The river town woke slowly", "In the library at the top"]
        outs = engine.generate(prompts, greedy)
        single = engine.generate(prompts[0], greedy)
        assert single["output_ids"] == outs[0]["output_ids"]
        for prompt, out in zip(prompts, outs):
            ids = engine.tokenizer.encode(prompt)
            assert out["output_ids"] == _hf_greedy(model_dir, ids, 8)
            assert out["text"] == engine.tokenizer.decode(out["output_ids"])
            assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert not _wait_gone(children), "Engine left processes behind"
    assert not os.path.exists(ipc_dir)


def test_engine_from_a_script_without_main_guard(tiny_model_dir, tmp_path):
    """Spawned children must not re-run the user's script (no `if __name__` guard needed)."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text(
        "import sglite\n"
        f"engine = sglite.Engine(model_path={str(tiny_model_dir('llama'))!r}, "
        "max_total_tokens=1024, device='cpu')\n"
        "out = engine.generate(input_ids=[5, 6, 7], sampling_params={'max_new_tokens': 3, "
        "'temperature': 0})\n"
        "print('TOKENS', out['output_ids'])\n"
        "engine.shutdown()\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("TOKENS") == 1
