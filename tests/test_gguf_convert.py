"""GGUF -> HF conversion, per architecture, from tiny random checkpoints written as GGUF the
way llama.cpp writes them (fixtures/gguf_writer.py): the converted folder has the original's
weights (exactly, or within the quantization error), a config that makes the same model in
transformers, the same tokenizer; it agrees with transformers' own GGUF loader; files it
cannot convert are refused with a message naming why; the cache is reused, rebuilt when
the file or converter changes, and safe under concurrent conversions. The serving folder
(the default) holds no weights, only the name of the .gguf they are read from at load
(test_gguf_packed); `weights=True` writes them as float32 safetensors (the reference here).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fixtures.gguf_models import VARIANTS, GGUFFiles, load_weights
from fixtures.serving import child_env

TEXTS = [
    "The river town woke slowly under a grey sky.",
    "counting 42 numbers at 7 o'clock, then 12345",
    "naïve café 日本語 🙂  two  spaces\tand a tab",
    "<|im_start|>user\nhi<|im_end|>\n",
]
ROUND_TRIPS = [(v, "F32") for v in VARIANTS] + [
    ("llama", "F16"),
    ("llama", "Q8_0"),
    ("qwen2", "Q4_0"),
    ("gemma3", "Q8_0"),
    ("phi3_longrope", "Q8_0"),
    ("starcoder2", "BF16"),
]
# relative to a tensor's largest magnitude: at most half a quantization step
QUANT_TOL = {"F32": 0.0, "F16": 2**-11, "BF16": 2**-8, "Q8_0": 1 / 127, "Q4_0": 1 / 7}
TRANSFORMERS_GGUF_ARCHS = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "starcoder2"]


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    return GGUFFiles(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_dir(gguf_files):
    return gguf_files.source


@pytest.fixture(scope="module")
def gguf_file(gguf_files):
    return gguf_files.file


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _logits(folder, weights=None, config_from=None, n=40):
    """Logits of transformers' model for `folder` (config from `config_from` if given,
    weights from `weights` if given) on n fixed tokens (longer than the 8-token windows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_from or folder))
    if weights is None:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), config=config, dtype=torch.float32
        )
    elif any(".experts." in name for name in weights):
        # transformers 5 holds experts fused in memory: its loader converts the checkpoint's
        # per-expert tensors, load_state_dict would not
        model = _from_state_dict(config, weights)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    ids = torch.randint(7, 260, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids).logits[0]


def _from_state_dict(config, weights):
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file(weights, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)


@pytest.mark.parametrize(
    ("variant", "qtype"), ROUND_TRIPS, ids=[f"{v}-{q}" for v, q in ROUND_TRIPS]
)
def test_round_trip_gives_the_checkpoint_back(variant, qtype, hf_dir, gguf_file, cache):
    from transformers import AutoTokenizer

    from sglite.models.gguf import convert_gguf_to_hf

    src = hf_dir(variant)
    out = convert_gguf_to_hf(gguf_file(variant, qtype), cache_root=cache, weights=True)
    config = json.loads((out / "config.json").read_text())
    # llama.cpp writes Mistral as llama (no window): transformers' Llama is the same model
    assert config["architectures"] == [VARIANTS[variant][1].replace("Mistral", "Llama")]

    ref, ours = load_weights(src), load_weights(out)
    tied = config["tie_word_embeddings"]
    assert set(ours) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, want in ref.items():
        if name not in ours:
            continue
        tol = QUANT_TOL["F32" if want.ndim == 1 else qtype] * want.abs().max().item()
        err = (ours[name] - want).abs().max().item()
        assert err <= tol + 2e-7, (name, err, tol)  # 2e-7: gemma's norm (1 + w) - 1 in fp32

    # the config makes the same model: the converted weights under either config agree
    torch.testing.assert_close(
        _logits(out), _logits(out, weights=ours, config_from=src), atol=1e-5, rtol=0
    )
    if qtype == "F32":  # and it is the original model
        torch.testing.assert_close(_logits(out), _logits(src), atol=1e-5, rtol=0)

    want_tok, got_tok = (
        AutoTokenizer.from_pretrained(str(src)),
        AutoTokenizer.from_pretrained(str(out)),
    )
    for text in TEXTS:
        ids = want_tok(text).input_ids
        assert got_tok(text).input_ids == ids, text
        assert got_tok.decode(ids, skip_special_tokens=True) == want_tok.decode(
            ids, skip_special_tokens=True
        )
    for attr in ("bos_token", "eos_token", "pad_token"):
        assert getattr(got_tok, attr) == getattr(want_tok, attr), attr
    chat = [{"role": "user", "content": "hi"}]
    assert got_tok.apply_chat_template(chat, tokenize=False) == want_tok.apply_chat_template(
        chat, tokenize=False
    )
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert config["eos_token_id"] in eos and got_tok.convert_tokens_to_ids("<|im_end|>") in eos


@pytest.mark.parametrize("variant", TRANSFORMERS_GGUF_ARCHS)
def test_matches_transformers_own_gguf_loader(variant, gguf_file, cache):
    """transformers reads the same Q8_0 file into the same tensors and config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sglite.models.gguf import convert_gguf_to_hf

    path = gguf_file(variant, "Q8_0")
    out = convert_gguf_to_hf(path, cache_root=cache, weights=True)
    theirs_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ours_config = AutoConfig.from_pretrained(str(out))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(ours_config, key) == getattr(theirs_config, key), key
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ours_config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_weights(out)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name].float()), name


def test_folder_loads_in_sglite_like_transformers(gguf_file, cache):
    """Each converted architecture sglite registers (the others are skipped by name until
    their model class lands): its logits equal transformers' on the same folder."""
    from transformers import AutoModelForCausalLM

    from fixtures.model_driver import Driver
    from sglite.model_executor.model_runner import ModelRunner
    from sglite.models.gguf import convert_gguf_to_hf
    from sglite.models.registry import MODELS

    ids = torch.randint(7, 260, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    checked = []
    for variant, (_, arch, _, _) in VARIANTS.items():
        if arch not in MODELS:
            continue
        out = convert_gguf_to_hf(gguf_file(variant, "Q8_0"), cache_root=cache, weights=True)
        runner = ModelRunner(out, device="cpu", max_total_tokens=512, max_running_requests=2)
        driver = Driver(runner)
        seq = driver.new_seq()
        ours = driver.extend([seq], [ids], return_all_logits=True)
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0, msg=variant)
        checked.append(variant)
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"} <= set(checked), checked


def test_the_serving_folder_has_no_weights_and_names_its_gguf(gguf_file, tmp_path):
    from sglite.models.gguf import convert_gguf_to_hf
    from sglite.models.gguf.weights import gguf_source

    path = gguf_file("qwen2", "Q4_0")
    out = convert_gguf_to_hf(path, cache_root=tmp_path)
    assert gguf_source(out) == path.resolve() and not list(out.glob("*.safetensors"))
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    full = convert_gguf_to_hf(path, cache_root=tmp_path, weights=True)
    assert full != out and gguf_source(full) is None and list(full.glob("*.safetensors"))


def test_a_file_written_from_random_tensors_without_a_checkpoint(hf_dir, tmp_path):
    """write_gguf_from streams tensors made on the fly (how a 7B-shaped file is written
    without a 7B checkpoint); the folder holds exactly them."""
    from transformers import AutoConfig

    from fixtures.gguf_writer import random_tensors, write_gguf_from
    from sglite.models.gguf import convert_gguf_to_hf

    tok_dir = hf_dir("qwen3")
    config = AutoConfig.from_pretrained(str(tok_dir))
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8})
    path = write_gguf_from(config, random_tensors(config), tok_dir, tmp_path / "r.gguf")
    ours = load_weights(convert_gguf_to_hf(path, cache_root=tmp_path, weights=True))
    want = dict(random_tensors(config))
    assert set(ours) == set(want)
    for name, t in want.items():
        assert torch.equal(ours[name], torch.from_numpy(t)), name
    assert ours["model.layers.0.mlp.up_proj.weight"].shape == (256, 128)


# ---------------------------------------------------------------------- refusals
REFUSALS = {
    "arch": ({"arch": "falcon"}, "GGUF architecture 'falcon' is not supported; supported: gemma"),
    "tensor": (
        {"extra_tensors": {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}},
        "tensor 'blk.0.attn_sinks.weight' has no counterpart in transformers' LlamaForCausalLM",
    ),
    "tensor_type": (
        {"extra_tensors": {"blk.0.ffn_gate.scale": np.zeros(4, np.int8)}},
        "tensor blk.0.ffn_gate.scale has type I8, which cannot be dequantized",
    ),
    "tokenizer": (
        {"metadata": {"tokenizer.ggml.model": "rwkv"}},
        "GGUF tokenizer 'rwkv' is not supported; supported: gpt2, llama",
    ),
    "math_key": (
        {"metadata": {"llama.logit_scale": 0.5}},
        "llama.logit_scale = 0.5 changes the model's math",
    ),
    "rope_type": (
        {"metadata": {"llama.rope.scaling.type": "longrope"}},
        "llama.rope.scaling.type 'longrope' is not supported",
    ),
    "partial_rotary": (
        {"metadata": {"llama.rope.dimension_count": 8}},
        "partial rotary is not supported for llama",
    ),
    "per_layer_heads": (
        {"metadata": {"llama.attention.head_count_kv": [2, 1, 2]}},
        "llama.attention.head_count_kv differs between layers",
    ),
    "split": ({"metadata": {"split.count": 3}}, "one part of a split GGUF (3 files)"),
    "experts": (
        {"metadata": {"llama.expert_count": 8}},
        "a mixture-of-experts GGUF (llama.expert_count = 8)",
    ),
    "not_causal": (
        {"metadata": {"llama.attention.causal": False}},
        "llama.attention.causal = False changes the model's math",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unconvertible_files_are_refused_with_the_reason(case, gguf_file, tmp_path):
    from sglite.models.gguf import UnsupportedGGUF, convert_gguf_to_hf

    kwargs, message = REFUSALS[case]
    path = gguf_file("llama", "F32", **kwargs)
    with pytest.raises(UnsupportedGGUF, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert_gguf_to_hf(path, cache_root=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []  # nothing half-built is left


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    from sglite.models.gguf import UnsupportedGGUF, convert_gguf_to_hf

    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedGGUF, match="model.gguf: not a readable GGUF file"):
        convert_gguf_to_hf(path, cache_root=tmp_path)


# ---------------------------------------------------------------------- cache
def test_cache_is_reused_and_rebuilt_when_the_file_or_converter_changes(
    gguf_file, tmp_path, monkeypatch
):
    import os
    import shutil

    from sglite.models.gguf import convert, convert_gguf_to_hf

    path = tmp_path / "m.gguf"
    shutil.copy(gguf_file("qwen3"), path)
    first = convert_gguf_to_hf(path, cache_root=tmp_path)
    calls = []
    real = convert._convert
    monkeypatch.setattr(convert, "_convert", lambda *a: (calls.append(a), real(*a)))
    assert convert_gguf_to_hf(path, cache_root=tmp_path) == first and calls == []

    os.utime(path, ns=(1, 1))  # a changed file (mtime): a new folder
    second = convert_gguf_to_hf(path, cache_root=tmp_path)
    assert second != first and len(calls) == 1
    monkeypatch.setattr(convert, "CONVERTER_VERSION", convert.CONVERTER_VERSION + 1)
    third = convert_gguf_to_hf(path, cache_root=tmp_path)
    assert third not in (first, second) and third.name.endswith(f"-v{convert.CONVERTER_VERSION}")

    (third / ".sglite-complete").unlink()  # a half-written folder (a crash) is rebuilt
    assert convert_gguf_to_hf(path, cache_root=tmp_path) == third and len(calls) == 3
    assert (third / ".sglite-complete").is_file()


def test_concurrent_conversions_share_one_folder(gguf_file, tmp_path):
    """Two processes converting the same file into the same cache at once both get the
    complete folder; no temporary folder is left."""
    path = gguf_file("gemma2")
    code = (
        "import sys; from pathlib import Path; from sglite.models.gguf import convert_gguf_to_hf;"
        "print(convert_gguf_to_hf(sys.argv[1], cache_root=Path(sys.argv[2])))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(tmp_path),
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    folders = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(folders) == 1
    (folder,) = folders
    assert (tmp_path / "gguf" / folder.rsplit("/", 1)[-1] / ".sglite-complete").is_file()
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [folder.rsplit("/", 1)[-1]]


def test_large_models_are_written_in_shards(gguf_file, tmp_path, monkeypatch):
    from sglite.models.gguf import convert, convert_gguf_to_hf
    from sglite.models.loader import safetensors_files

    monkeypatch.setattr(convert, "SHARD_BYTES", 64 << 10)
    out = convert_gguf_to_hf(gguf_file("phi3"), cache_root=tmp_path, weights=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = safetensors_files(out)
    assert len(files) > 3 and {f.name for f in files} == set(index["weight_map"].values())
    assert not (out / "model.safetensors").exists()
    assert all(f.stat().st_size <= (64 << 10) + 4096 or len(_weights_in(f)) == 1 for f in files)
    torch.testing.assert_close(
        _logits(out),
        _logits(convert_gguf_to_hf(gguf_file("phi3"), cache_root=tmp_path / "one", weights=True)),
    )


def _weights_in(file):
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())
