"""NativeDecodeStep: a CPU decode step of the dense decoder skeleton in one native call.

The CPU's answer to CUDA graphs. A decode step of a small model is a few hundred short
kernels; issued one by one from Python, the interpreter, tensor allocation and torch's
dispatch cost more than the kernels (SmolLM2-135M, one row: ~6 of 12 ms). Here the layers
run inside `sglite._core.DecodeStep` (rust/step): the same kernels, in the same order, on
buffers of their own; the embedding, the rotary lookups, the attention plans and the LM head
stay in Python (once per step each). Logits equal the per-op path's within f32 rounding
(tests/test_native_step.py).

`build(runner)` decides once, at start-up, and the log says which path decode takes and
why. The rule (`unsupported_reason`): a CPU runner with one rank and float32 activations; the
dense skeleton (no MoE, no MLA) in the `pre` or `sandwich` layout with RMS norms (plain or
Gemma's 1 + w), a gated SiLU or tanh-GELU MLP, no q/k/v clipping, q/k norms per head if any
(RMS); every projection held in panels (`--quant-kernel int16` or `int8` on a GGUF file) with
no float rows; the `cpu` attention backend reading the pool in place. Everything else takes
the per-op path, which computes the same thing.
"""

from __future__ import annotations

import logging

import torch

from sglite.layers.layernorm import RMSNorm

logger = logging.getLogger(__name__)


def _raw(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A float32 contiguous CPU tensor of `t`'s values (a new one only when it must)."""
    return t.detach().to(torch.float32).contiguous()


def unsupported_reason(runner) -> str | None:
    """None when the native step serves this runner's decode batches, else why not."""
    from sglite.attention.cpu import CpuAttnBackend
    from sglite.models.decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderModel

    if runner.device.type != "cpu":
        return f"it runs on the CPU, not {runner.device.type}"
    if runner.tp_size > 1:
        return "tensor parallelism (the layers all-reduce between kernels)"
    if runner.dtype != torch.float32:
        return f"activations in {runner.dtype} (it computes in float32)"
    if (
        not isinstance(runner.attn_backend, CpuAttnBackend)
        or not runner.attn_backend.kernel_reads_pool
    ):
        return f"attention backend {runner.attention_backend_name!r} (it uses cpu's kernel)"
    model = getattr(runner.model, "model", None)
    spec = getattr(runner.model, "spec", None)
    if type(model) is not DecoderModel or spec is None:
        return f"{type(runner.model).__name__} is not the dense decoder skeleton"
    if spec.layout not in ("pre", "sandwich"):
        return f"the {spec.layout!r} layout"
    if not spec.gated_mlp:
        return "a non-gated MLP"
    if spec.act not in _GATES:
        return f"the MLP activation {spec.act!r} (gated silu or tanh gelu only)"
    if spec.clip_qkv is not None:
        return "clip_qkv"
    if spec.qk_norm is not None and (
        spec.qk_norm.scope != "head" or spec.qk_norm.norm.kind not in ("rms", "rms_offset")
    ):
        return f"q/k norms over {spec.qk_norm.scope!r} ({spec.qk_norm.norm.kind})"
    for i, layer in enumerate(model.layers):
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention:
            return f"layer {i} is not the skeleton's attention"
        if type(layer.mlp) is not DecoderMLP:
            return f"layer {i}'s MLP is {type(layer.mlp).__name__}"
        norms = [
            m
            for m in layer.children()
            if isinstance(m, torch.nn.Module) and m not in (layer.self_attn, layer.mlp)
        ]
        if not all(isinstance(m, RMSNorm) for m in norms):
            return f"layer {i}'s norms are not RMS norms"
        for name, linear in _linears(layer):
            packed = getattr(linear, "packed", None)
            if packed is None or packed._panels is None or packed._dense:
                kernel = getattr(packed, "kernel", None)
                return f"{name} is not held in panels (float weights, or --quant-kernel {kernel})"
    if not isinstance(model.norm, RMSNorm):
        return "the final norm is not an RMS norm"
    return None


_GATES = {
    "silu": "silu",
    "swish": "silu",
    **{
        n: "gelu_tanh"
        for n in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_accurate", "gelu_python_tanh")
    },
}


def _linears(layer) -> list[tuple[str, torch.nn.Module]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [
        ("qkv_proj", attn.qkv_proj),
        ("o_proj", attn.o_proj),
        ("gate_up_proj", mlp.gate_up_proj),
        ("down_proj", mlp.down_proj),
    ]


def build(runner) -> NativeDecodeStep | None:
    """The native step for this runner, or None (logged either way)."""
    try:
        from sglite import _core
    except ImportError:
        _core = None
    reason = unsupported_reason(runner)
    if reason is None and _core is None:
        reason = "the native module sglite._core is not built"
    elif reason is None and not hasattr(_core, "DecodeStep"):
        reason = "the native module lacks DecodeStep (rebuild it)"
    if reason is not None:
        logger.info("decode step: per-op path (the native step does not take %s)", reason)
        return None
    step = NativeDecodeStep(runner)
    logger.info(
        "decode step: native, %d layers in one call (%s activations, %s KV pool)",
        len(runner.model.model.layers), step.precision, str(runner.kv_pool.dtype).removeprefix("torch."),
    )  # fmt: skip
    return step


class NativeDecodeStep:
    """`can_run(batch)` / `forward(batch)` -> logits, for decode batches (see the module doc).
    Holds every tensor the native step reads, for as long as it lives."""

    def __init__(self, runner) -> None:
        from sglite import _core
        from sglite.attention.cpu_kernel import share_torch_openmp

        share_torch_openmp()
        self.runner = runner
        lm, model, spec = runner.model, runner.model.model, runner.model.spec
        pool = runner.kv_pool
        self._alive: list[torch.Tensor] = []
        first = model.layers[0]
        attn = first.self_attn
        self.precision = attn.qkv_proj.packed.precision
        layers = [self._layer(i, layer, pool) for i, layer in enumerate(model.layers)]
        desc = dict(
            hidden=model.norm.weight.shape[0],
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=first.mlp.down_proj.packed.in_features,
            eps=float(model.norm.eps),
            qk_eps=float(attn.q_norm.eps) if attn.q_norm is not None else 1e-6,
            layout=spec.layout,
            gate=_GATES[spec.act],
            residual_scale=float(spec.residual_scale),
            kv_dtype=str(pool.dtype).removeprefix("torch."),
            precision=self.precision,
            final_norm=self._keep(model.norm.weight),
            layers=layers,
        )
        self.step = _core.DecodeStep(desc)
        self.lm = lm

    def _keep(self, t: torch.Tensor | None) -> tuple[int, int] | None:
        if t is None:
            return None
        t = _f32(t)
        self._alive.append(t)
        return _raw(t)

    def _linear(self, layer) -> dict:
        packed = layer.packed
        bias = getattr(layer, "bias", None)
        self._alive += [seg.data for _, seg in packed.segments]
        return dict(
            segments=list(packed._panels),
            bias=self._keep(bias),
            out_features=packed.out_features,
            in_features=packed.in_features,
        )

    def _layer(self, i: int, layer, pool) -> dict:
        attn, mlp = layer.self_attn, layer.mlp
        sandwich = hasattr(layer, "post_self_attn_layernorm")
        k, v = pool.k_buffer[i], pool.v_buffer[i]
        self._alive += [k, v]
        return dict(
            input_norm=self._keep(layer.input_layernorm.weight),
            mlp_norm=self._keep(layer.post_attention_layernorm.weight),
            attn_out_norm=self._keep(layer.post_self_attn_layernorm.weight) if sandwich else None,
            mlp_out_norm=self._keep(layer.post_mlp_layernorm.weight) if sandwich else None,
            q_norm=self._keep(attn.q_norm.weight) if attn.q_norm is not None else None,
            k_norm=self._keep(attn.k_norm.weight) if attn.k_norm is not None else None,
            qkv=self._linear(attn.qkv_proj),
            o=self._linear(attn.o_proj),
            gate_up=self._linear(mlp.gate_up_proj),
            down=self._linear(mlp.down_proj),
            rope=self.runner.model.model.rope_idx[i],
            scale=float(attn.attn.scaling),
            logit_cap=float(attn.attn.logit_cap),
            sinks=self._keep(attn.sinks) if attn.sinks is not None else None,
            k_pool=(k.data_ptr(), k.numel() * k.element_size()),
            v_pool=(v.data_ptr(), v.numel() * v.element_size()),
        )

    def can_run(self, batch) -> bool:
        return batch.forward_mode.is_decode() and batch.batch_size > 0

    def forward(self, batch) -> torch.Tensor:
        """The batch's logits (the attention backend's metadata already initialised)."""
        model = self.lm.model
        x = _f32(model.embed(batch.input_ids))
        ropes = [emb.lookup(batch.positions, batch) for emb in model.rotary_embs]
        ropes = [(rows.to(torch.int64).contiguous(), table.contiguous()) for rows, table in ropes]
        backend = batch.attn_backend
        plans, layer_plans = [], []
        for layer in model.layers:
            plan = backend.decode_plan(layer.self_attn.attn)
            for j, known in enumerate(plans):
                if known is plan:
                    layer_plans.append(j)
                    break
            else:
                layer_plans.append(len(plans))
                plans.append(plan)
        loc = batch.out_cache_loc.to(torch.int64).contiguous()
        self.step.run(
            _raw(x),
            [(_raw(rows), _raw(table)) for rows, table in ropes],
            _raw(loc),
            plans,
            layer_plans,
            torch.get_num_threads(),
        )
        return self.lm.logits_processor(x, self.lm.lm_head, batch)
