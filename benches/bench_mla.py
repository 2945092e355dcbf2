"""MLA: the latent pool's bytes per token vs per-head K/V's, and decode absorbed vs expanded on CPU.

1. Bytes per token (bf16, every layer) of DeepSeek-V2-Lite's and DeepSeek-V3's attention,
   read from transformers configs with their real shapes by sglite's DeepSeek spec: the
   MLAKVPool row (latent 512 + rope 64) vs what per-head K (192) and V (128) would take. A
   pool of 64k tokens is built on the meta device to check the bytes.
2. One decode step of one latent-attention layer (V2-Lite's: 16 heads, latent 512, rope 64,
   nope 128, v 128; fp32) for `--batch` requests at each context length, on the CPU:
   - absorbed: what sglite's decode runs (LatentAttention through the cpu backend: q folded
     into the latent space, the native kernel over the pool's rows, W_UV after);
   - expanded: the prefill form run for a decode token (up-project every cached latent to
     per-head K/V with kv_b_proj, then attention), i.e. what decode would cost without
     absorption.
   Warm-up, then the median of `--iters` steps.

Prints a table, one summary line, and writes JSON (default bench_results/bench_mla.json).

    python benches/bench_mla.py [--contexts 256 1024 4096] [--batch 4] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "python"))  # run from a source checkout too

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sglite.attention.attend import attend_tokens  # noqa: E402
from sglite.attention.cpu import CpuAttnBackend  # noqa: E402
from sglite.layers.latent_attention import LatentAttention, MLASpec  # noqa: E402
from sglite.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglite.mem_cache.mla_pool import MLALayout  # noqa: E402
from sglite.model_executor.forward_batch import ForwardBatch  # noqa: E402
from sglite.models.decoder_spec import ConfigFields  # noqa: E402
from sglite.models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402
from sglite.models.model_config import ModelConfig  # noqa: E402

SHAPES = {
    # real shapes; first_k_dense_replace = layers: only the attention matters here
    "DeepSeek-V2-Lite": ("DeepseekV2Config", dict(
        num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=10944, vocab_size=102400, first_k_dense_replace=27,
    )),
    "DeepSeek-V3": ("DeepseekV3Config", dict(
        num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=18432, vocab_size=129280, first_k_dense_replace=61,
    )),
}  # fmt: skip


def layout_of(name: str, num_layers: int | None = None) -> tuple[MLALayout, MLASpec]:
    """The pool layout (of `num_layers` layers; None: the model's) and the attention spec."""
    import transformers

    cls, fields = SHAPES[name]
    hf = getattr(transformers, cls)(architectures=["DeepseekV2ForCausalLM"], **fields)
    cfg = ModelConfig.from_hf(hf)
    m = DeepseekV2ForCausalLM.decoder_spec(ConfigFields(cfg)).mla
    layers = cfg.num_layers if num_layers is None else num_layers
    layout = MLALayout(layers, m.kv_lora_rank, m.qk_rope_head_dim, cfg.num_heads,
                       m.qk_head_dim, m.v_head_dim)  # fmt: skip
    return layout, m


def pool_bytes(name: str) -> dict:
    layout, _ = layout_of(name)
    dtype = torch.bfloat16
    pool = layout.build(65536, 16, dtype, "meta")
    assert pool.memory_bytes() == (65536 + 16) * layout.bytes_per_token(dtype)
    mla, mha = layout.bytes_per_token(dtype), layout.mha_bytes_per_token(dtype)
    return {"model": name, "layers": layout.num_layers, "mla_bytes_per_token": mla,
            "mha_bytes_per_token": mha, "ratio": mha / mla}  # fmt: skip


class _Setup:
    """One layer's latent pool filled for `batch` requests of `context` tokens, a decode batch."""

    def __init__(self, context: int, batch: int, layer: LatentAttention, layout: MLALayout):
        gen = torch.Generator().manual_seed(0)
        slots = batch * (context + 1)
        self.pool = layout.build(slots, 1, torch.float32, "cpu")
        for buf in self.pool.buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
        self.table = ReqToTokenPool(batch, context + 1, "cpu")
        rows = self.table.alloc(batch)
        perm = torch.randperm(slots, generator=gen) + 1  # scattered slots
        self.slots = [perm[i * (context + 1) : (i + 1) * (context + 1)] for i in range(batch)]
        for row, s in zip(rows, self.slots):
            self.table.write(row, 0, s)
        self.batch = ForwardBatch.decode(
            input_ids=[0] * batch, seq_lens=[context + 1] * batch, req_pool_indices=rows,
            out_cache_loc=[int(s[-1]) for s in self.slots], req_to_token_pool=self.table,
            kv_pool=self.pool,
        )  # fmt: skip
        s = layer.spec
        self.inputs = (torch.randn(batch, layer.num_heads, s.qk_nope_head_dim, generator=gen),
                       torch.randn(batch, layer.num_heads, s.qk_rope_head_dim, generator=gen),
                       torch.randn(batch, s.kv_lora_rank, generator=gen),
                       torch.randn(batch, s.qk_rope_head_dim, generator=gen))  # fmt: skip


def absorbed_step(layer: LatentAttention, setup: _Setup, backend) -> torch.Tensor:
    backend.init_forward_metadata(setup.batch)
    setup.batch.attn_backend = backend
    return layer(*setup.inputs, setup.batch)


def expanded_step(layer: LatentAttention, setup: _Setup) -> torch.Tensor:
    """The prefill form for one decode token per request: up-project every cached latent."""
    s, h = layer.spec, layer.num_heads
    q_nope, q_pe, latent, k_pe = setup.inputs
    rows = torch.cat([latent, k_pe], -1).unsqueeze(1)
    setup.pool.set_kv(layer.layer_id, setup.batch.out_cache_loc, rows, None)
    q = torch.cat([q_nope, q_pe], -1)
    outs = []
    for i, slots in enumerate(setup.slots):
        keys = setup.pool.kv_buffer[layer.layer_id].index_select(0, slots.long())[:, 0]
        kv = layer.kv_b_proj(keys[:, : s.kv_lora_rank]).view(
            -1, h, s.qk_nope_head_dim + s.v_head_dim
        )
        k = torch.cat([kv[..., : s.qk_nope_head_dim],
                       keys[:, None, s.kv_lora_rank :].expand(-1, h, -1)], -1)  # fmt: skip
        outs.append(attend_tokens(q[i : i + 1], k, kv[..., s.qk_nope_head_dim :],
                                  layer.expanded, None))  # fmt: skip
    return torch.cat(outs).reshape(len(outs), -1)


def _median_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_times(contexts: list[int], batch: int, iters: int) -> list[dict]:
    one_layer, spec = layout_of("DeepSeek-V2-Lite", num_layers=1)
    heads = one_layer.num_heads
    torch.manual_seed(0)
    kv_b = nn.Linear(spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim),
                     bias=False)  # fmt: skip
    nn.init.normal_(kv_b.weight, std=0.02)
    layer = LatentAttention(spec, heads, spec.qk_head_dim**-0.5, 0, kv_b)
    results = []
    with torch.inference_mode():
        for context in contexts:
            setup = _Setup(context, batch, layer, one_layer)
            backend = CpuAttnBackend(
                SimpleNamespace(device=torch.device("cpu"), kv_pool=setup.pool)
            )
            a = absorbed_step(layer, setup, backend)
            e = expanded_step(layer, setup)
            err = float((a - e).abs().max())

            def absorbed(setup=setup, backend=backend):
                return absorbed_step(layer, setup, backend)

            def expanded(setup=setup):
                return expanded_step(layer, setup)

            results.append({
                "context": context, "batch": batch,
                "absorbed_ms": _median_ms(absorbed, iters),
                "expanded_ms": _median_ms(expanded, iters),
                "max_abs_diff": err,
            })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench_results/bench_mla.json")
    args = parser.parse_args()
    memory = [pool_bytes(name) for name in SHAPES]
    print(f"{'model':18} {'layers':>6} {'MLA B/token':>12} {'MHA B/token':>12} {'ratio':>6}")
    for m in memory:
        print(f"{m['model']:18} {m['layers']:6d} {m['mla_bytes_per_token']:12,d} "
              f"{m['mha_bytes_per_token']:12,d} {m['ratio']:6.1f}")  # fmt: skip
    times = decode_times(args.contexts, args.batch, args.iters)
    print(f"\ndecode step, one V2-Lite attention layer, fp32, {torch.get_num_threads()} threads")
    head = f"{'context':>8} {'batch':>5} {'absorbed ms':>12} {'expanded ms':>12} {'speed-up':>8}"
    print(f"{head} {'max |diff|':>10}")
    for t in times:
        print(f"{t['context']:8d} {t['batch']:5d} {t['absorbed_ms']:12.3f} "
              f"{t['expanded_ms']:12.3f} {t['expanded_ms'] / t['absorbed_ms']:8.1f} "
              f"{t['max_abs_diff']:10.1e}")  # fmt: skip
    last = times[-1]
    print(
        f"\nbench_mla: V3 pool {memory[1]['mla_bytes_per_token']:,} B/token vs MHA "
        f"{memory[1]['mha_bytes_per_token']:,} ({memory[1]['ratio']:.0f}x); decode at "
        f"{last['context']} tokens absorbed {last['absorbed_ms']:.2f} ms vs expanded "
        f"{last['expanded_ms']:.2f} ms ({last['expanded_ms'] / last['absorbed_ms']:.1f}x)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"memory": memory, "decode": times}, indent=2))


if __name__ == "__main__":
    main()
