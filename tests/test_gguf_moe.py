"""GGUF mixture-of-experts files (qwen2moe, qwen3moe): what the converter makes of their
stacked expert tensors equals what transformers' own GGUF loader reads, and routing the
converter does not run is refused. The round trip (weights, config, tokenizer) and sglite's
logits on the converted folder are tests/test_gguf_convert.py's, over the same variants.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.gguf_models import GGUFFiles, load_weights


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return GGUFFiles(tmp_path_factory).file


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("variant", ["qwen2_moe", "qwen3_moe"])
def test_moe_experts_match_transformers_own_gguf_loader(variant, gguf_file, cache):
    """transformers reads the stacked expert tensors of the same Q8_0 file into its fused
    in-memory form (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`): our
    per-expert tensors, stacked the same way, equal them; every other tensor is equal too.
    (Its GGUF config reader leaves `moe_intermediate_size` at the class default, so the
    skeleton is built from our config.)"""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from sglite.models.gguf import convert_gguf_to_hf

    path = gguf_file(variant, "Q8_0")
    out = convert_gguf_to_hf(path, cache_root=cache, weights=True)
    config = AutoConfig.from_pretrained(str(out))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_weights(out)
    experts = range(config.num_experts)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts"

        def stack(proj, prefix=prefix):
            return torch.stack([ours.pop(f"{prefix}.{e}.{proj}.weight") for e in experts])

        gate_up = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        assert torch.equal(gate_up, theirs.pop(f"{prefix}.gate_up_proj").float()), i
        assert torch.equal(stack("down_proj"), theirs.pop(f"{prefix}.down_proj").float()), i
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name].float().reshape(t.shape)), name


MOE_REFUSALS = {
    "norm": ({"qwen3moe.expert_weights_norm": False}, "qwen3moe.expert_weights_norm = False"),
    "gating": ({"qwen3moe.expert_gating_func": 2}, "qwen3moe.expert_gating_func = 2"),
    "scale": ({"qwen3moe.expert_weights_scale": 2.5}, "qwen3moe.expert_weights_scale = 2.5"),
}


@pytest.mark.parametrize("case", sorted(MOE_REFUSALS))
def test_moe_routing_the_converter_does_not_implement_is_refused(case, gguf_file, tmp_path):
    from sglite.models.gguf import UnsupportedGGUF, convert_gguf_to_hf

    metadata, message = MOE_REFUSALS[case]
    path = gguf_file("qwen3_moe", "F32", metadata=metadata)
    with pytest.raises(UnsupportedGGUF, match=message):
        convert_gguf_to_hf(path, cache_root=tmp_path)
