"""RoPE pieces against plain references: frequencies of every type against transformers' own
functions, and partial / interleaved layouts (reduced to the half-split rotation by a permutation
of each head's dims) against a direct rotation of the checkpoint's layout."""

from __future__ import annotations

import pytest
import torch

from sglite.layers import cpu_ops
from sglite.layers.rope_scaling import longrope_inv_freq, static_inv_freq
from sglite.layers.rotary_embedding import RotaryEmbedding, permute_heads, rotary_permutation


def _hf_config(rope: dict, head_dim: int = 64, max_positions: int = 4096):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=dict(rope, rope_theta=10000.0),
    )


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="linear", factor=4.0),
        dict(
            rope_type="llama3",
            factor=8.0,
            original_max_position_embeddings=512,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        ),
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
        dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=256, truncate=False),
        dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=512,
            mscale=0.707,
            mscale_all_dim=1.0,
            beta_fast=16,
            beta_slow=2,
        ),
        dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=1024,
            partial_rotary_factor=0.5,
        ),
    ],
    ids=[
        "linear",
        "llama3",
        "yarn",
        "yarn-no-truncate",
        "yarn-mscale",
        "yarn-partial",
    ],
)
def test_static_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config(rope)
    want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    rotary_dim = int(64 * rope.get("partial_rotary_factor", 1.0))
    got, scale = static_inv_freq(
        rope["rope_type"], rotary_dim, 10000.0, config.rope_parameters, 4096
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_longrope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pairs = 24  # partial rotary 0.75 of head_dim 64
    rope = dict(
        rope_type="longrope",
        partial_rotary_factor=0.75,
        original_max_position_embeddings=512,
        short_factor=[1.0 + i / 10 for i in range(pairs)],
        long_factor=[2.0 + i for i in range(pairs)],
    )
    config = _hf_config(rope)
    short, long, scale = longrope_inv_freq(48, 10000.0, config.rope_parameters, 4096)
    want_short, want_scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=513)
    torch.testing.assert_close(short, want_short, rtol=1e-6, atol=0)
    torch.testing.assert_close(long, want_long, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale) and scale > 1


def _rotate_reference(x, positions, inv_freq, rotary_dim, interleaved):
    """The checkpoint's layout, rotated directly: neox halves or GPT-J pairs of the first
    rotary_dim dims; the rest passes."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    angles = positions[:, None].float() * inv_freq  # [T, pairs]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot.chunk(2, dim=-1)
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, rest], dim=-1)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "head_dim, rotary_dim, interleaved",
    [(16, 16, True), (16, 8, False), (16, 8, True), (32, 12, False), (64, 16, True)],
)
def test_partial_and_interleaved_layouts_reduce_to_the_half_split_rotation(
    head_dim, rotary_dim, interleaved, native, monkeypatch
):
    if not native:
        monkeypatch.setattr(cpu_ops, "rope", lambda *args: None)
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    q, k = torch.randn(5, 3, head_dim, generator=gen), torch.randn(5, 1, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 7, 100, 511])
    rope = RotaryEmbedding(head_dim, 512, 10000.0, rotary_dim=rotary_dim)
    perm = rotary_permutation(head_dim, rotary_dim, interleaved)
    assert perm is not None and sorted(perm.tolist()) == list(range(head_dim))
    got_q, got_k = rope(positions, q[..., perm], k[..., perm])
    inv_freq, _ = static_inv_freq("default", rotary_dim, 10000.0, None, 512)
    for got, x in ((got_q, q), (got_k, k)):
        want = _rotate_reference(x, positions, inv_freq, rotary_dim, interleaved)
        torch.testing.assert_close(got, want[..., perm], atol=1e-5, rtol=1e-5)
    # the permutation as it applies to checkpoint rows: heads of head_dim rows each
    rows = torch.arange(2 * head_dim)[:, None].float()
    permuted = permute_heads(rows, perm, head_dim, 0)[:, 0].long()
    assert permuted.tolist() == perm.tolist() + (perm + head_dim).tolist()


def test_the_half_split_whole_head_needs_no_permutation():
    assert rotary_permutation(64, 64, False) is None
