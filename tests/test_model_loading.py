"""Checkpoint loading, config forms, the model registry, memory sizing and the pools."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from fixtures.model_driver import Driver
from fixtures.tiny_models import rewrite_config_as_v4
from sglite.mem_cache.memory_pool import KVPool, ReqToTokenPool
from sglite.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglite.model_executor.model_runner import ModelRunner
from sglite.models.model_config import ModelConfig
from sglite.models.registry import get_model_class, supported_architectures

PROMPT = [5, 9, 200, 31, 7, 7, 100, 64, 3, 12, 250, 18]


def _prefill(runner, prompt=PROMPT) -> torch.Tensor:
    driver = Driver(runner)
    seq = driver.new_seq()
    out = driver.extend([seq], [prompt], return_all_logits=True)
    driver.release(seq)
    return out


def _hf_logits(path, prompt=PROMPT) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def test_v4_config_form_sharded_and_tied_checkpoint(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama", tie_word_embeddings=True, sharded=True)
    dst = tmp_path / "v4"
    shutil.copytree(src, dst)
    rewrite_config_as_v4(dst)
    config = json.loads((dst / "config.json").read_text())
    assert "rope_theta" in config and "rope_parameters" not in config
    assert (dst / "model.safetensors.index.json").is_file()
    runner = ModelRunner(dst, device="cpu", max_total_tokens=256)
    assert runner.model_config.tie_word_embeddings
    assert runner.model_config.rope_theta == 10000.0
    torch.testing.assert_close(_prefill(runner), _hf_logits(src), atol=1e-3, rtol=0)


def test_v4_config_keeps_rope_scaling(tiny_model_dir, tmp_path):
    scaling = {"rope_type": "linear", "factor": 2.0}
    dst = tmp_path / "v4s"
    shutil.copytree(tiny_model_dir("llama", rope_scaling=scaling), dst)
    rewrite_config_as_v4(dst)
    config = ModelConfig.from_pretrained(dst)
    assert config.rope_scaling["factor"] == 2.0
    assert config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) == "linear"


def test_model_config_fields(tiny_model_dir, tmp_path):
    dst = tmp_path / "gen"
    shutil.copytree(tiny_model_dir("qwen3"), dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    cfg = ModelConfig.from_pretrained(dst)
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "Qwen3ForCausalLM",
        2,
        4,
        2,
    )
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.context_length) == (16, 64, 384, 512)
    assert cfg.eos_token_ids == (2, 0)


def test_unsupported_architecture_names_the_supported_ones(tiny_model_dir, tmp_path):
    dst = tmp_path / "gpt"
    shutil.copytree(tiny_model_dir("llama"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM.*not supported.*LlamaForCausalLM"):
        ModelRunner(dst, device="cpu", max_total_tokens=256)
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    }
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"


def test_missing_and_unknown_tensors_are_errors(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("qwen2")
    tensors = load_file(src / "model.safetensors")
    for name, mutate in (("missing", "drop"), ("unknown", "add")):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        broken = dict(tensors)
        if mutate == "drop":
            del broken["model.layers.1.self_attn.k_proj.bias"]
        else:
            broken["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        save_file(broken, str(dst / "model.safetensors"))
        with pytest.raises(ValueError, match="k_proj|extra"):
            ModelRunner(dst, device="cpu", max_total_tokens=256)


def test_bad_model_path_and_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        ModelRunner(tmp_path / "nope", device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelRunner(tmp_path, device="cpu")
    from sglite.model_executor.model_runner import resolve_dtype

    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16  # SGLang's auto
    assert resolve_dtype("auto", torch.device("cuda"), "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


def test_bf16_runs_close_to_fp32(tiny_model_dir):
    path = tiny_model_dir("llama")
    fp32 = _prefill(ModelRunner(path, device="cpu", max_total_tokens=256))
    bf16 = _prefill(ModelRunner(path, device="cpu", dtype="bfloat16", max_total_tokens=256))
    assert bf16.dtype == torch.float32  # logits are always float32
    assert (bf16 - fp32).abs().max() < 0.15


def test_memory_sizing_and_exposed_attributes(tiny_runner):
    runner = tiny_runner(
        "llama", page_size=16, max_total_tokens=1000, max_running_requests=5, context_length=128
    )
    assert runner.max_total_num_tokens == 992  # whole pages
    assert runner.allocator.available_size() == 992
    assert runner.kv_pool.k_buffer[0].shape == (992 + 16, 2, 16)
    assert len(runner.kv_pool.v_buffer) == 2
    assert runner.req_to_token_pool.req_to_token.shape == (6, 128)
    assert runner.model_config.context_length == 128
    assert (runner.tokenizer_path / "tokenizer.json").is_file()
    assert runner.attention_backend_name == "cpu"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        tiny_runner("llama", attention_backend="flash")


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.alloc(4) is None and pool.available_size() == 3
    rows = pool.alloc(2)
    assert rows == [1, 2]
    pool.write(rows[1], 2, np.array([7, 8]))
    assert pool.req_to_token[2, :4].tolist() == [0, 0, 7, 8]
    with pytest.raises(ValueError, match="context is 8"):
        pool.write(rows[0], 7, [1, 2])
    pool.free(rows[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[0])
    with pytest.raises(ValueError, match="not in 1..3"):
        pool.free(0)
    assert pool.available_size() == 2


def test_kv_pool_set_kv_and_validation():
    pool = KVPool(8, 4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    k = torch.arange(4.0).view(2, 1, 2)
    pool.set_kv(1, torch.tensor([5, 9]), k, -k)
    assert pool.k_buffer[1][9].tolist() == [[2.0, 3.0]]
    assert pool.v_buffer[1][5].tolist() == [[-0.0, -1.0]]
    assert pool.k_buffer[0].abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        KVPool(6, 4, 1, 1, 2, torch.float32, "cpu")


def test_forward_batch_builders(tiny_runner):
    runner = tiny_runner("qwen3")
    args = dict(req_to_token_pool=runner.req_to_token_pool, kv_pool=runner.kv_pool)
    b = ForwardBatch.extend(
        input_ids=[[1, 2, 3], [4]],
        prefix_lens=[2, 5],
        req_pool_indices=[3, 1],
        out_cache_loc=[9, 10, 11, 12],
        **args,
    )
    assert b.forward_mode is ForwardMode.EXTEND and b.forward_mode.is_extend()
    assert b.positions.tolist() == [2, 3, 4, 5]
    assert b.seq_lens_cpu == [5, 6] and b.extend_seq_lens_cpu == [3, 1]
    assert b.batch_size == 2 and b.num_tokens == 4
    d = ForwardBatch.decode(
        input_ids=torch.tensor([4, 5]),
        seq_lens=[7, 3],
        req_pool_indices=[1, 2],
        out_cache_loc=np.array([5, 6]),
        **args,
    )
    assert d.positions.tolist() == [6, 2] and d.forward_mode.is_decode()
    with pytest.raises(ValueError, match="out_cache_loc has 3 slots for 4"):
        ForwardBatch.extend(
            input_ids=[[1, 2, 3], [4]],
            prefix_lens=[0, 0],
            req_pool_indices=[1, 2],
            out_cache_loc=[1, 2, 3],
            **args,
        )
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.extend(
            input_ids=[[]], prefix_lens=[0], req_pool_indices=[1], out_cache_loc=[], **args
        )
    with pytest.raises(ValueError, match="2 requests but 1 input ids"):
        ForwardBatch.decode(
            input_ids=[1], seq_lens=[2, 3], req_pool_indices=[1, 2], out_cache_loc=[1, 2], **args
        )


def test_bench_one_batch_prints_numbers(tiny_model_dir, capsys):
    from sglite.bench_one_batch import main

    result = main(
        [
            "--model-path",
            str(tiny_model_dir("qwen2")),
            "--batch-size",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "5",
            "--page-size",
            "16",
        ]
    )
    out = capsys.readouterr().out
    assert "prefill: latency" in out and "decode:" in out
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
