"""Request fields the OpenAI routes used to drop, through the real server and the `openai`
client: the model's generation_config.json as sampling defaults, `logit_bias`,
`stop_token_ids`, `min_tokens`; `user` and unknown fields are accepted."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from fixtures.serving import start_server


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama whose generation_config.json asks for greedy decoding."""
    path = tmp_path_factory.mktemp("greedy-llama") / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return path


def _start(model_dir, tmp_path_factory, *extra):
    log = tmp_path_factory.mktemp("log") / "server.log"
    return start_server(
        ["--model-path", str(model_dir), "--max-total-tokens", "4096",
         "--served-model-name", "m", *extra],
        log, fake=False, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = _start(model_dir, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def hf_greedy_text(model_dir, prompt: str, steps: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = tok.encode(prompt)
    n = len(seq)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return tok.decode(seq[n:])


def test_generation_config_defaults_apply_to_unset_fields(server, tiny_model_dir):
    c = client(server)
    prompt = "The capital of France is"
    extra = {"ignore_eos": True}
    outs = {
        c.completions.create(model="m", prompt=prompt, max_tokens=8, extra_body=extra)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(outs) == 1, "temperature 0 from generation_config.json: greedy, repeatable"
    assert outs.pop() == hf_greedy_text(tiny_model_dir("llama"), prompt, 8)
    assert "sampling defaults from the model's generation_config.json" in server.log()
    # an explicit temperature wins over the model's default
    sampled = {
        c.completions.create(
            model="m", prompt=prompt, max_tokens=8, temperature=1.5, seed=s, extra_body=extra
        )
        .choices[0]
        .text
        for s in range(4)
    }
    assert len(sampled) > 1


def test_logit_bias_and_stop_token_ids(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    forced = tok.encode(" the", add_special_tokens=False)[-1]
    c = client(server)
    r = c.completions.create(
        model="m",
        prompt="Hello",
        max_tokens=5,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == tok.decode([forced] * 5)
    r = c.completions.create(
        model="m",
        prompt="Hello",
        max_tokens=5,
        logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced], "min_tokens": 2, "ignore_eos": True},
        user="someone",
    )
    choice = r.choices[0]
    # min_tokens bans the stop token for 2 tokens, then it is sampled and stops the request
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == 3


def test_bad_logit_bias_is_400(server):
    for bias, word in (
        ({"x": 1}, "token ids"),
        ({"1": 500}, "logit_bias[1]"),
        ({"999999": 1}, "out of range"),
    ):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "m", "prompt": "hi", "logit_bias": bias},
            timeout=30,
        )
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_openai_defaults_flag_ignores_generation_config(model_dir, tmp_path_factory):
    srv = _start(model_dir, tmp_path_factory, "--sampling-defaults", "openai")
    try:
        c = client(srv)
        texts = {
            c.completions.create(
                model="m", prompt="Hello", max_tokens=8, seed=s, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for s in range(4)
        }
        assert len(texts) > 1, "temperature 1 by default: samples differ"
        assert "generation_config.json" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
