"""The pieces of the safetensors-quantized checkpoints, without a full model where possible:
the AWQ / GPTQ nibble orders against the fixture's independent packer, the repack into Q4_0 /
Q4_1 blocks and the rounding it adds, the w8a8 int8 math against a float64 reference, the
detection and every refusal by message, and the CUDA branch's wiring: a model on CPU whose
layers hold the checkpoint's tensors and call fake `sglite_kernels.quant_gemm` kernels.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fixtures.quant_checkpoints import AWQ_ORDER, _words, write_quantized
from sglite import quantization as quant
from sglite.layers import quant_int4
from sglite.layers.quant_rows import Int8Rows
from sglite.models import quant_checkpoint as qc


def test_unpack_reads_awq_and_gptq_nibble_orders():
    levels = np.arange(16).reshape(2, 8) % 16
    awq = torch.from_numpy(_words(levels, AWQ_ORDER))
    gptq = torch.from_numpy(_words(levels))
    # by hand: AWQ's nibble k of the first word holds output AWQ_ORDER[k]
    assert int(awq[0, 0]) == sum(o << (4 * k) for k, o in enumerate(AWQ_ORDER))
    assert torch.equal(
        quant_int4.unpack_int32(awq, quant_int4.AWQ_ORDER), torch.from_numpy(levels).int()
    )
    assert torch.equal(quant_int4.unpack_int32(gptq), torch.from_numpy(levels).int())
    rand = torch.randint(0, 16, (5, 24), dtype=torch.int32)
    for order in (None, quant_int4.AWQ_ORDER):
        assert torch.equal(quant_int4.unpack_int32(quant_int4.pack_int32(rand, order), order), rand)


def _groups(out=48, in_f=128, group=32, sym=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (out, in_f), generator=g, dtype=torch.int32)
    shape = (in_f // group, out)
    zeros = torch.full(shape, 8) if sym else torch.randint(0, 17, shape, generator=g)
    scales = (torch.rand(shape, generator=g) * 0.02 + 1e-3).half().float()
    return levels, zeros.int(), scales


def test_repack_is_q4_1_with_f16_m_rounding_and_q4_0_exact_when_symmetric():
    for group in (32, 64, 128):
        levels, zeros, scales = _groups(group=group)
        g_idx = quant_int4.default_g_idx(128, group)
        want = quant_int4.dequantize(levels, zeros, scales, g_idx)
        rows = quant_int4.repack(levels, zeros, scales, group, "t")
        assert rows.qtype == "Q4_1"
        err = (rows.dequantize() - want).abs()
        bound = 2**-11 * (scales * zeros).T[:, g_idx].abs() + 1e-7
        assert (err <= bound).all() and err.max() > 0
        assert err.max() <= 16 * 2**-11 * scales.max()  # under 1% of a quantization step
    levels, zeros, scales = _groups(sym=True)
    rows = quant_int4.repack(levels, zeros, scales, 32, "t")
    assert rows.qtype == "Q4_0"
    g_idx = quant_int4.default_g_idx(128, 32)
    assert torch.equal(rows.dequantize(), quant_int4.dequantize(levels, zeros, scales, g_idx))
    with pytest.raises(ValueError, match="group_size 16 .* multiple of 32"):
        quant_int4.repack(*_groups(group=16)[:3], 16, "t")


def test_int8_rows_compute_per_token_int8_products():
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (40, 96), generator=g, dtype=torch.int8)
    sw = torch.rand(40, generator=g) * 0.01
    x = torch.randn(7, 96, generator=g)
    got = Int8Rows(w, sw).matmul(x)
    xd = x.double()
    sx = xd.abs().amax(1, keepdim=True) / 127
    xq = torch.round(xd / sx).clamp(-127, 127)
    want = (xq @ w.double().T) * sx * sw.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
    float_ref = x @ (w.float() * sw[:, None]).T
    rel = (got - float_ref).abs().max() / float_ref.abs().max()
    assert 0 < rel < 0.02  # the activations' rounding, a per-token int8 step
    # q, k, v rows in one QKV layer: merged into one segment, the same numbers
    from sglite.layers.quant_linear import QuantQKVParallelLinear

    layer = QuantQKVParallelLinear(96, 8, 2, 1, bias=False, dtype=torch.float32)
    parts = Int8Rows(w, sw).split([16, 8, 8, 8])
    for sid, part in zip("qkv", parts[:3]):
        layer.load_packed(part, sid)
    assert len(layer.packed._own_segments()) == 1
    torch.testing.assert_close(layer(x), got[:, :32])


def test_resolve_detects_the_checkpoints_method_and_refuses_disagreement():
    kw = dict(is_gguf=False, device_type="cpu")
    assert quant.resolve(None, checkpoint_method="awq", **kw) == "awq"
    assert quant.resolve("gptq", checkpoint_method="gptq", **kw) == "gptq"
    assert quant.resolve(None, checkpoint_method="mxfp4", **kw) == "none"  # gpt-oss decodes it
    assert quant.resolve(None, **kw) == "none"
    with pytest.raises(ValueError, match="--quantization fp8 disagrees .* 'awq'"):
        quant.resolve("fp8", checkpoint_method="awq", **kw)
    with pytest.raises(ValueError, match="--quantization none disagrees .* 'w8a8_int8'"):
        quant.resolve("none", checkpoint_method="w8a8_int8", **kw)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        quant.resolve(None, checkpoint_method="bitsandbytes", **kw)
    with pytest.raises(ValueError, match="--quantization awq serves .* has none"):
        quant.resolve("awq", **kw)
    with pytest.raises(ValueError, match="--quantization gptq .* a .gguf file"):
        quant.resolve("gptq", is_gguf=True, device_type="cpu")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"quant_method": "awq", "bits": 8}, r"bits=8 is not supported"),
        ({"quant_method": "awq", "version": "gemv"}, r"version='gemv' is not supported"),
        ({"quant_method": "awq", "zero_point": False}, r"zero_point=False is not supported"),
        ({"quant_method": "gptq", "bits": 3}, r"bits=3"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
        ({"quant_method": "gptq", "lm_head": True}, r"lm_head=True"),
        ({"quant_method": "gptq", "dynamic": {"-:.*": {}}}, r"dynamic="),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt='e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size"),
    ],
)
def test_read_scheme_refuses_fields_that_change_the_math(config, match):
    with pytest.raises(ValueError, match=match):
        qc.read_scheme(SimpleNamespace(quantization_config=config))


def test_read_scheme_reads_group_size_format_and_blocks():
    read = lambda **q: qc.read_scheme(SimpleNamespace(quantization_config=q))  # noqa: E731
    assert read(quant_method="gptq", bits=4, group_size=128) == qc.QuantScheme("gptq", 128, 1)
    assert read(quant_method="gptq", checkpoint_format="gptq_v2").zero_offset == 0
    assert read(quant_method="awq", w_bit=4, q_group_size=64).group_size == 64
    assert read(quant_method="fp8", weight_block_size=[128, 128]).block_size == (128, 128)


def test_permuted_g_idx_and_flag_disagreement_are_refused_at_load(tiny_model_dir, tmp_path):
    from sglite.model_executor.model_runner import ModelRunner

    quant_dir, _ = write_quantized(tiny_model_dir("llama"), tmp_path, "gptq", act_order=True)
    with pytest.raises(ValueError, match="g_idx is permuted .* desc_act=True"):
        ModelRunner(str(quant_dir), device="cpu", max_total_tokens=256)
    with pytest.raises(ValueError, match="--quantization awq disagrees .* 'gptq'"):
        ModelRunner(str(quant_dir), device="cpu", max_total_tokens=256, quantization="awq")


@pytest.fixture
def fake_kernels(monkeypatch):
    """`sglite_kernels.quant_gemm` replaced by float references that record their calls, and
    the loader told to hold the CUDA forms (on CPU tensors)."""
    calls = []

    def fp8_linear(x, weight, weight_scale, block_size=None, bias=None):
        assert weight.dtype == torch.float8_e4m3fn
        calls.append(("fp8", weight, weight_scale, block_size))
        s = weight_scale.float()
        if block_size is not None:
            bn, bk = block_size
            s = s.repeat_interleave(bn, 0)[: weight.shape[0]].repeat_interleave(bk, 1)
            s = s[:, : weight.shape[1]]
        elif s.numel() > 1:
            s = s.reshape(-1, 1)
        return (x.float() @ (weight.float() * s).T).to(x.dtype)

    def int4_linear(x, qweight, scales, qzeros, group_size, layout, g_idx=None, bias=None):
        calls.append((layout, qweight, qzeros, group_size, g_idx))
        offset = 1 if layout == "gptq" else 0
        levels, zeros, s = quant_int4.unpack(layout, qweight, qzeros, scales, zero_offset=offset)
        if g_idx is None:
            g_idx = quant_int4.default_g_idx(levels.shape[1], group_size)
        return (x.float() @ quant_int4.dequantize(levels, zeros, s, g_idx).T).to(x.dtype)

    module = types.ModuleType("sglite_kernels.quant_gemm")
    module.fp8_linear, module.int4_linear = fp8_linear, int4_linear
    monkeypatch.setitem(sys.modules, "sglite_kernels.quant_gemm", module)
    monkeypatch.setattr(qc, "kernel_forms", lambda device: True)
    return calls


@pytest.mark.parametrize(
    ("method", "opts"),
    [
        ("awq", dict(group_size=32)),
        ("gptq", dict(group_size=32, act_order=True)),
        ("fp8", dict(scale="block", block=(32, 32))),
        ("fp8", dict(scale="tensor")),
    ],
    ids=["awq", "gptq-act-order", "fp8-block", "fp8-tensor"],
)
def test_cuda_branch_hands_the_checkpoint_tensors_to_the_kernels(
    fake_kernels, tiny_model_dir, tmp_path, method, opts
):
    from test_quant_safetensors import PROMPTS, greedy, runner

    quant_dir, ref_dir = write_quantized(tiny_model_dir("llama"), tmp_path, method, **opts)
    want, want_logits = greedy(runner(ref_dir), PROMPTS)
    got, got_logits = greedy(runner(quant_dir), PROMPTS)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    ckpt = load_file(str(quant_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    seen = {id(c[1]): c for c in fake_kernels}
    assert len(fake_kernels) >= 7 * 2  # every projection of both layers, on every step
    if method == "fp8":
        calls = [
            c for c in fake_kernels if torch.equal(c[1].float(), ckpt[f"{name}.weight"].float())
        ]
        assert calls and calls[0][3] == opts.get("block")
        return
    calls = [c for c in seen.values() if torch.equal(c[1], ckpt[f"{name}.qweight"])]
    assert calls, "the kernel was not given the checkpoint's qweight"
    layout, _, qzeros, group, g_idx = calls[0]
    assert (layout, group) == (method, 32)
    assert torch.equal(qzeros, ckpt[f"{name}.qzeros"])
    if opts.get("act_order"):
        assert torch.equal(g_idx, ckpt[f"{name}.g_idx"])


@pytest.mark.parametrize(
    ("method", "opts"),
    [
        ("gptq", dict(group_size=32, act_order=True)),
        ("awq", dict(group_size=32)),
        ("fp8", dict(scale="block", block=(32, 32))),
    ],
    ids=["gptq-act-order", "awq", "fp8-block"],
)
def test_cuda_branch_with_the_real_triton_kernels(
    monkeypatch, tiny_model_dir, tmp_path, method, opts
):
    """The same CUDA branch on the real `sglite_kernels.quant_gemm` kernels (Triton's
    interpreter on CPU tensors): the loader's and the kernels' layout contracts agree (GPTQ's
    stored `zero - 1`, AWQ's nibble order, FP8 block scales)."""
    from test_quant_safetensors import greedy, runner

    monkeypatch.setattr(qc, "kernel_forms", lambda device: True)
    quant_dir, ref_dir = write_quantized(tiny_model_dir("llama"), tmp_path, method, **opts)
    prompts = [[1, 5, 9, 14]]
    want, want_logits = greedy(runner(ref_dir), prompts)
    got, got_logits = greedy(runner(quant_dir), prompts)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-3, rtol=1e-3)
