"""Gemma 2 and Gemma 3 beyond the family table (tests/test_model_families.py runs both there).

- What the tiny checkpoints switch on reaches the layers and bites: Gemma 2's attention and
  final soft-caps and `query_pre_attn_scalar`, its alternating windows; transformers' logits
  change when a cap is removed, so a model ignoring one would fail the family tests.
- Gemma 3's two rotary tables: sliding layers read the local base, the full layer the global
  base with `rope_scaling`; the transformers 4.x config form (`rope_local_base_freq`,
  `rope_scaling` on top) gives the same tables and logits.
- Gemma 2 on the torch_native and Triton (interpreted) attention backends, not only the
  native CPU one: prefill and greedy decoding with caps and windows equal transformers'
  (and Gemma 2/3 on CUDA with the compiled kernels and CUDA graphs, under SGL_TEST_GPU=1).
- Chat through /v1/chat/completions with a Gemma-3-style template (a system turn folded into
  the first user turn, `model` turns): the prompt the server renders is the template's.
- The real Gemma 3 270M (the Q4_K_M GGUF as transformers reads it,
  tests/fixtures/gemma3_reference.py): logits of a 739-token prompt (past the 512 window)
  within 5e-4 of transformers and the same greedy tokens; skipped without the package.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fixtures.model_driver import Driver, hf_greedy
from fixtures.tiny_families import ATTN_CAP, FINAL_CAP, GEMMA_WINDOW

ATOL = 1e-4
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def _runner(path, **kwargs):
    from sglite.model_executor.model_runner import ModelRunner

    kwargs.setdefault("max_total_tokens", 512)
    kwargs.setdefault("device", "cpu")
    return ModelRunner(path, **kwargs)


def _prefill(runner, prompt=PROMPT) -> torch.Tensor:
    driver = Driver(runner)
    return driver.extend([driver.new_seq()], [prompt], return_all_logits=True)


def _hf_logits(hf, prompt=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def test_gemma2_caps_scale_and_windows_reach_the_layers(tiny_model_dir):
    model = _runner(tiny_model_dir("gemma2")).model
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [GEMMA_WINDOW, None] * 2
    assert {a.logit_cap for a in attns} == {ATTN_CAP}
    assert {a.scaling for a in attns} == {24**-0.5}  # query_pre_attn_scalar, not head_dim
    assert model.logits_processor.softcap == FINAL_CAP


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_gemma2_cap_changes_transformers_logits(cap, tiny_hf_model):
    """Same weights (same seed) without the cap: the logits move, so ignoring it shows."""
    capped = _hf_logits(tiny_hf_model("gemma2"))
    uncapped = _hf_logits(tiny_hf_model("gemma2", config={cap: None}))
    assert (capped - uncapped).abs().max() > 0.1


def test_gemma3_layers_read_the_rotary_table_of_their_type(tiny_model_dir):
    decoder = _runner(tiny_model_dir("gemma3")).model.model
    assert decoder.rope_idx == [0, 0, 0, 0, 0, 1]  # five sliding layers, then the full one
    local, full = decoder.rotary_embs
    assert (local.base, local.rope_type) == (100.0, "default")
    assert (full.base, full.rope_type, full.params["factor"]) == (10000.0, "linear", 4.0)
    assert (local.cos_sin[40] - full.cos_sin[40]).abs().max() > 0.1


def test_gemma3_config_in_the_v4_form_gives_the_same_tables(tiny_model_dir, tmp_path):
    """Hub configs of Gemma 3 carry `rope_theta`, `rope_local_base_freq` and `rope_scaling`
    on top; transformers 5 reads them into per-layer-type rope_parameters, as sglite must."""
    from sglite.models.model_config import ModelConfig, RopeParams

    src, dst = tiny_model_dir("gemma3"), tmp_path / "v4"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(
        rope_theta=10000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    (dst / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(dst)
    assert cfg.rope_for(0) == RopeParams(100.0, None)
    assert cfg.rope_for(5) == RopeParams(10000.0, {"rope_type": "linear", "factor": 4.0})
    assert cfg.rope_by_layer_type == ModelConfig.from_pretrained(src).rope_by_layer_type
    torch.testing.assert_close(_prefill(_runner(dst)), _prefill(_runner(src)), atol=0, rtol=0)


def test_per_layer_type_ropes_need_every_layer_type():
    from transformers import Gemma3TextConfig

    from sglite.models.model_config import ModelConfig

    hf = Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3ForCausalLM"])
    hf.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ValueError, match=r"no entry for the layer types \['sliding_attention'\]"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_gemma2_on_other_attention_backends_matches_transformers(
    backend, tiny_model_dir, tiny_hf_model
):
    """Caps and windows in each backend's prefill and decode (page size 16)."""
    if backend == "triton":
        kernels = pytest.importorskip("sglite_kernels")
        if not kernels.interpreted():
            pytest.skip("CPU triton cases need Triton's interpreter, off under SGL_TEST_GPU=1")
    hf = tiny_hf_model("gemma2")
    driver = Driver(_runner(tiny_model_dir("gemma2"), attention_backend=backend, page_size=16))
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True)
    torch.testing.assert_close(logits, _hf_logits(hf), atol=ATOL, rtol=0)
    expected, ref_logits = hf_greedy(hf, PROMPT, 5)
    tokens = [int(logits[-1].argmax())]
    for step in range(1, 5):
        out = driver.decode([seq], [tokens[-1]])[0]
        torch.testing.assert_close(out, ref_logits[step], atol=ATOL, rtol=0)
        tokens.append(int(out.argmax()))
    assert tokens == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_on_cuda_with_graphs_matches_transformers(arch, tiny_model_dir, tiny_hf_model):
    """The compiled kernels (fp32) with caps, windows and two rotary tables, and the decode
    CUDA graphs."""
    hf = tiny_hf_model(arch)
    runner = _runner(
        tiny_model_dir(arch), device="cuda", dtype="float32", page_size=16,
        max_total_tokens=1024, attention_backend="triton",
    )  # fmt: skip
    driver = Driver(runner)
    seq = driver.new_seq()
    logits = driver.extend([seq], [PROMPT], return_all_logits=True).cpu()
    torch.testing.assert_close(logits, _hf_logits(hf), atol=ATOL, rtol=0)
    expected, _ = hf_greedy(hf, PROMPT, 6)
    tokens = [int(logits[-1].argmax())]
    for _ in range(5):
        tokens.append(int(driver.decode([seq], [tokens[-1]])[0].argmax()))
    assert tokens == expected
    assert runner.graph_runner.num_replays > 0


# Gemma 3's template shape: a system turn goes into the first user turn, assistant turns
# are `model` turns (unlike Gemma 1/2, whose templates raise on a system role)
GEMMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% set first = messages[0] %}"
    "{% if first['role'] == 'system' %}{% set prefix = first['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}"
    "{% endif %}{% for m in turns %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ prefix if loop.first else '' }}{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_gemma3_chat_with_a_system_turn_renders_the_template(tiny_model_dir, tmp_path):
    import httpx
    from transformers import AutoTokenizer

    from fixtures.serving import start_server

    model = tmp_path / "gemma3"
    shutil.copytree(tiny_model_dir("gemma3"), model)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.chat_template = GEMMA3_STYLE_TEMPLATE
    tok.save_pretrained(str(model))
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where is the river?"},
        {"role": "assistant", "content": "Below the town."},
        {"role": "user", "content": "And the bridge?"},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<start_of_turn>user\nAnswer briefly.\n\nWhere is the river?" in rendered
    expected_len = len(tok(rendered, add_special_tokens=False).input_ids)
    args = ["--model-path", str(model), "--max-total-tokens", "2048", "--served-model-name", "g3"]
    server = start_server(args, tmp_path / "server.log", fake=False)
    try:
        body = {"model": "g3", "messages": messages, "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (expected_len, 4)
    finally:
        assert server.stop() == 0, server.log()


# ---------------------------------------------------------------- the real Gemma 3 270M

REAL_ATOL = 5e-4  # 18 real layers, logits up to ~50 over 739 positions: 1.2e-4 seen
REAL_STEPS = 12


@pytest.fixture(scope="module")
def gemma3_270m():
    from fixtures import gemma3_reference

    try:
        gemma3_reference.package_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return gemma3_reference.reference_dir()


@pytest.mark.slow
def test_gemma3_270m_matches_transformers_past_the_window(gemma3_270m):
    """The prompt: the tiny models' corpus three times and a piece (739 tokens). Past the
    512-token window only the global layers see its first copy; greedy decoding copies it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fixtures.tiny_models import CORPUS

    tok = AutoTokenizer.from_pretrained(str(gemma3_270m))
    text = " ".join(CORPUS.split())
    prompt = tok("\n\n".join([text] * 3) + "\n\n" + text[:200]).input_ids
    assert len(prompt) > 700
    hf = AutoModelForCausalLM.from_pretrained(gemma3_270m, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # decode the full length
    keep = len(prompt) - 480  # the positions from 480 on, across the window's edge
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), logits_to_keep=keep).logits[0].float()
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=REAL_STEPS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    expected = out.sequences[0, len(prompt) :].tolist()
    del hf

    runner = _runner(gemma3_270m, dtype="float32", context_length=1024, max_total_tokens=1024)
    assert runner.model_config.sliding_window_for(0) == 512
    driver = Driver(runner)
    seq = driver.new_seq()
    logits = driver.extend([seq], [prompt], return_all_logits=True)[-keep:]
    err = (logits - ref).abs().max().item()
    assert err <= REAL_ATOL, f"prompt logits differ by {err}"
    tokens, step_errs = [int(logits[-1].argmax())], []
    for step in range(1, REAL_STEPS):
        step_logits = driver.decode([seq], [tokens[-1]])[0]
        step_errs.append((step_logits - out.logits[step][0].float()).abs().max().item())
        tokens.append(int(step_logits.argmax()))
    assert max(step_errs) <= REAL_ATOL, f"decode logits differ by up to {max(step_errs)}"
    assert tokens == expected
    assert tok.decode(tokens).strip() in text  # it copies the corpus from 500+ tokens back
