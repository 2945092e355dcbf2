"""gpt-oss MXFP4 checkpoints: expert weights stored as E2M1 blocks with E8M0 scales load
decoded, to the logits of the same weights in full precision.

The test writes its own MXFP4 checkpoint from the tiny gpt-oss (tests/fixtures/tiny_moe.py):
random 4-bit codes and scales for every expert tensor, named as the Hub's gpt-oss
checkpoints name them (`experts.gate_up_proj_blocks [E, 2I, H/32, 16]`, `_scales
[E, 2I, H/32]`, the same for `down_proj`), with `quantization_config.quant_method
"mxfp4"`. References: a float64 decode written here from the format's definition (sign,
exponent and mantissa bits, not a table), and transformers' own loader of the MXFP4 folder
(`Mxfp4Config(dequantize=True)`, on CPU).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from fixtures.model_driver import Driver
from sglite.models.mxfp4 import Mxfp4Pairs, decode_mxfp4

ATOL = 1e-4
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(2)).tolist()
NOT_QUANTIZED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # fmt: skip


def e2m1_reference(code: int) -> float:
    """One E2M1 nibble: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:  # subnormal: 0 or 0.5
        return sign * mantissa * 0.5
    return sign * (1.0 + mantissa / 2) * 2.0 ** (exponent - 1)


def decode_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64, element by element of the last dims: low nibble first."""
    flat_b, flat_s = blocks.reshape(-1, blocks.shape[-1]), scales.reshape(-1)
    rows = []
    for block, scale in zip(flat_b.tolist(), flat_s.tolist()):
        values = []
        for byte in block:
            values += [e2m1_reference(byte & 0x0F), e2m1_reference(byte >> 4)]
        rows.append([v * 2.0 ** (scale - 127) for v in values])
    out = torch.tensor(rows, dtype=torch.float64)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def test_decode_matches_the_format_definition():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every byte once
    blocks = torch.cat([blocks, torch.randint(0, 256, (8, 16), generator=gen, dtype=torch.uint8)])
    scales = torch.randint(100, 160, (24,), generator=gen, dtype=torch.uint8)
    got = decode_mxfp4(blocks.view(2, 12, 16), scales.view(2, 12))
    want = decode_reference(blocks.view(2, 12, 16), scales.view(2, 12))
    assert got.dtype == torch.float32 and got.shape == (2, 384)
    assert torch.equal(got.double(), want)  # exact: every value is a float32


def test_unpaired_or_misshapen_halves_are_named():
    pairs = Mxfp4Pairs()
    blocks = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)
    assert pairs.add("m.experts.down_proj_blocks", blocks) is None
    with pytest.raises(ValueError, match=r"lack their other half.*m\.experts\.down_proj_blocks"):
        pairs.check_complete()
    with pytest.raises(ValueError, match=r"m\.experts\.down_proj: MXFP4 blocks .* do not pair"):
        pairs.add("m.experts.down_proj_scales", torch.zeros(2, 4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        decode_mxfp4(blocks.float(), torch.zeros(2, 4, 2))


def _random_mxfp4(rows: int, cols: int, experts: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen)
    scales = torch.randint(122, 125, (experts, rows, cols // 32), generator=gen)  # 2^-5..2^-3
    return blocks.to(torch.uint8), scales.to(torch.uint8)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """(the MXFP4 folder, the same weights decoded in float32 as transformers holds them)."""
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("gpt_oss")
    quant, plain = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("mxfp4_plain")
    shutil.copytree(src, quant, dirs_exist_ok=True)
    shutil.copytree(src, plain, dirs_exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    quantized, decoded = {}, {}
    gen = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = decoded[name] = tensor
            continue
        experts, cols, rows = tensor.shape  # transformers' [E, in, out]
        blocks, scales = _random_mxfp4(rows, cols, experts, gen)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        decoded[name] = decode_reference(blocks, scales).float().transpose(1, 2).contiguous()
    save_file(quantized, str(quant / "model.safetensors"), metadata={"format": "pt"})
    save_file(decoded, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": NOT_QUANTIZED,
    }
    (quant / "config.json").write_text(json.dumps(config, indent=2))
    return quant, plain


def _sglite_logits(path) -> torch.Tensor:
    from sglite.model_executor.model_runner import ModelRunner

    driver = Driver(ModelRunner(path, device="cpu", max_total_tokens=256))
    return driver.extend([driver.new_seq()], [PROMPT], return_all_logits=True)


@torch.no_grad()
def test_mxfp4_checkpoint_matches_its_decoded_weights(checkpoints):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quant, plain = checkpoints
    got = _sglite_logits(quant)
    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ref.std() > 0.1
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    hf_quant = AutoModelForCausalLM.from_pretrained(
        quant, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    torch.testing.assert_close(
        hf_quant.model.layers[1].mlp.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj
    )
    torch.testing.assert_close(got, hf_quant(torch.tensor([PROMPT])).logits[0], atol=ATOL, rtol=0)
