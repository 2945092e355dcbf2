"""The MoE layers on their own: router, expert compute, TP/EP split, DeepSeek and gpt-oss blocks.

Routers against a plain per-token reference written here (scores, groups, choice bias,
renormalisation, scaling) and against transformers' router modules of Qwen2-MoE, Mixtral,
DeepSeek-V2 (group_limited_greedy), DeepSeek-V3 (noaux_tc with a correction bias that
changes choices) and gpt-oss (biased gate, softmax after top-k). The grouped expert compute
against transformers' loop (`naive_forward`) and the sync-free form, packed and plain.
Blocks built from transformers' DeepSeek-V2/V3 MoE (shared experts, grouped routing,
scaling) and gpt-oss MLP (clamped SwiGLU, expert biases, its fused interleaved layout),
loaded from their state dicts. Tensor and expert parallelism at the layer: each simulated
rank's partial output summed over the ranks equals the whole block's.
"""

from __future__ import annotations

import pytest
import torch

from sglite.distributed import TPGroup
from sglite.layers.moe import (
    ExpertsSpec,
    FusedExperts,
    MoESpec,
    RouterSpec,
    SharedExpertSpec,
    SparseMoeBlock,
    moe_layer_schedule,
    select_experts,
)
from sglite.layers.moe.fused_cpu import (
    group_by_expert,
    grouped_forward,
    masked_forward,
    naive_forward,
    single_token_forward,
)
from sglite.models.causal_lm import STACKED_GATE_UP
from sglite.models.moe_lm import expert_target

H = 64


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g) * 0.2)


def _group_score(members: list[float], how: str) -> float:
    best = sorted(members, reverse=True)
    return best[0] if how == "max" else best[0] + best[1]


def _reference_route(logits: torch.Tensor, spec: RouterSpec, bias=None):
    """Token by token, in plain Python: the experts a router must pick and their weights."""
    out_w, out_ids = [], []
    size = spec.experts_per_group
    for row in logits.float():
        if spec.softmax_after_topk:
            picked = sorted(range(len(row)), key=lambda e: -row[e].item())[: spec.top_k]
            out_w.append(torch.stack([row[e] for e in picked]).softmax(0) * spec.scaling_factor)
            out_ids.append(picked)
            continue
        scores = row.softmax(0) if spec.scoring == "softmax" else row.sigmoid()
        choice = (scores + (bias if bias is not None else 0)).tolist()
        allowed = list(range(spec.num_experts))
        if spec.grouped:
            score = {
                g: _group_score(choice[g * size : (g + 1) * size], spec.group_score)
                for g in range(spec.num_groups)
            }
            groups = sorted(score, key=lambda g: -score[g])[: spec.topk_groups]
            allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        picked = sorted(allowed, key=lambda e: -choice[e])[: spec.top_k]
        w = torch.stack([scores[e] for e in picked])
        if spec.renormalize:
            w = w / w.sum()
        out_w.append(w * spec.scaling_factor)
        out_ids.append(picked)
    return torch.stack(out_w), torch.tensor(out_ids)


def _same_routing(got, want) -> None:
    """Equal expert sets per token, and equal weights expert by expert."""
    (gw, gi), (ww, wi) = got, want
    for t in range(gi.shape[0]):
        g = dict(zip(gi[t].tolist(), gw[t].tolist()))
        w = dict(zip(wi[t].tolist(), ww[t].tolist()))
        assert g.keys() == w.keys(), f"token {t}: experts {sorted(g)} != {sorted(w)}"
        for e in g:
            assert abs(g[e] - w[e]) < 1e-6, f"token {t} expert {e}: {g[e]} != {w[e]}"


ROUTERS = {
    "qwen_softmax": RouterSpec(16, 4),
    "qwen3_renorm": RouterSpec(16, 4, renormalize=True),
    "gpt_oss_order": RouterSpec(16, 4, softmax_after_topk=True),
    "v2_group_max": RouterSpec(16, 3, num_groups=4, topk_groups=2, scaling_factor=2.5),
    "v3_sigmoid_top2": RouterSpec(
        16,
        4,
        scoring="sigmoid",
        num_groups=4,
        topk_groups=2,
        group_score="top2_sum",
        correction_bias=True,
        renormalize=True,
        scaling_factor=2.5,
    ),  # fmt: skip
    "sigmoid_plain": RouterSpec(16, 2, scoring="sigmoid"),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_a_per_token_reference(name):
    spec = ROUTERS[name]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(48, spec.num_experts, generator=g) * 2
    bias = torch.randn(spec.num_experts, generator=g) if spec.correction_bias else None
    _same_routing(select_experts(logits, spec, bias), _reference_route(logits, spec, bias))


def test_correction_bias_changes_choices_not_weights():
    spec = ROUTERS["v3_sigmoid_top2"]
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 16, generator=g)
    bias = torch.randn(16, generator=g)
    w_bias, ids_bias = select_experts(logits, spec, bias)
    _, ids_plain = select_experts(logits, spec, torch.zeros(16))
    assert (ids_bias.sort().values != ids_plain.sort().values).any(), "the bias moved nothing"
    scores = logits.sigmoid().gather(1, ids_bias)  # the weights come from the plain scores
    expected = scores / scores.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(w_bias, expected)


def test_groups_restrict_the_choice():
    spec = ROUTERS["v2_group_max"]
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(3))
    _, ids = select_experts(logits, spec)
    groups = ids // spec.experts_per_group
    assert all(len(set(row)) <= spec.topk_groups for row in groups.tolist())
    _, free = select_experts(logits, RouterSpec(16, 3, scaling_factor=2.5))
    assert (free // 4).unique(dim=1).shape[1] > 0 and any(
        len(set(row)) > 2 for row in (free // 4).tolist()
    ), "ungrouped routing never spans 3 groups: the grouped test proves little"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts=4, top_k=5), "num_experts_per_tok=5"),
        (dict(num_experts=6, top_k=2, num_groups=4, topk_groups=2), "n_group=4 does not divide"),
        (dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5), "topk_group=5"),
        (dict(num_experts=8, top_k=5, num_groups=4, topk_groups=2), "exceeds the 2 group"),
        (dict(num_experts=8, top_k=2, scoring="sigmoid", softmax_after_topk=True), "softmax"),
        (dict(num_experts=8, top_k=2, scoring="relu"), "scoring 'relu'"),
    ],
)
def test_router_spec_refuses_what_cannot_route(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterSpec(**kwargs)


def _hf(name: str, **config):
    import transformers

    return getattr(transformers, name)(hidden_size=H, **config)


@pytest.mark.parametrize(
    ("module", "config", "spec"),
    [
        ("models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
         _hf("Qwen2MoeConfig", num_experts=16, num_experts_per_tok=4), RouterSpec(16, 4)),
        ("models.mixtral.modeling_mixtral.MixtralTopKRouter",
         _hf("MixtralConfig", num_local_experts=16, num_experts_per_tok=4),
         RouterSpec(16, 4, renormalize=True)),
        ("models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter",
         _hf("GptOssConfig", num_local_experts=16, num_experts_per_tok=4),
         RouterSpec(16, 4, softmax_after_topk=True, bias=True)),
    ],
)  # fmt: skip
def test_router_module_matches_transformers(module, config, spec):
    import importlib

    path, cls = module.rsplit(".", 1)
    hf = getattr(importlib.import_module(f"transformers.{path}"), cls)(config)
    _randomize(hf, 4)
    ours = __import__("sglite.layers.moe", fromlist=["TopKRouter"]).TopKRouter(
        spec, H, dtype=torch.float32
    )
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5))
    _, hf_w, hf_ids = hf(x)
    _same_routing(ours(x), (hf_w, hf_ids))


@pytest.mark.parametrize("num_tokens", [1, 7, 96])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_grouped_compute_matches_the_naive_loop(num_tokens, packed):
    spec = ExpertsSpec(8, 32)
    experts = FusedExperts(spec, H, dtype=torch.float32)
    _randomize(experts, 6)
    w13, w2 = experts.w13_weight.clone(), experts.w2_weight.clone()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, H, generator=g)
    logits = torch.randn(num_tokens, 8, generator=g)
    logits[:, 5] = -1e9  # an expert no token chooses
    weights, ids = select_experts(logits, RouterSpec(8, 2))
    if packed:
        assert experts.prepack()
    want = naive_forward(x, ids, weights, w13, w2)
    torch.testing.assert_close(experts(x, ids, weights), want, atol=1e-5, rtol=0)
    sync_free = masked_forward(x, ids, weights, 0, 8, experts.run_expert)
    torch.testing.assert_close(sync_free, want, atol=1e-5, rtol=0)


def test_grouping_keeps_only_the_local_experts():
    ids = torch.tensor([[0, 5], [3, 2], [5, 6], [7, 1]])
    weights = torch.arange(8, dtype=torch.float32).view(4, 2)
    groups = group_by_expert(ids, weights, expert_start=4, num_local=4, num_experts=8)
    assert groups.counts == [0, 2, 1, 1]
    assert groups.token_idx.tolist() == [0, 2, 2, 3]
    assert groups.weights.view(-1).tolist() == [1.0, 4.0, 5.0, 6.0]

    def scale(e, rows):  # local expert e multiplies by e + 1
        return rows * (e + 1)

    out = grouped_forward(torch.ones(4, 3), groups, scale)
    assert out[:, 0].tolist() == [2 * 1, 0, 2 * 4 + 3 * 5, 4 * 6]
    for t in range(4):  # the batch-1 path drops the same experts
        one = single_token_forward(
            torch.ones(1, 3), ids[t : t + 1], weights[t : t + 1], 4, 4, scale
        )
        assert one[0, 0].item() == out[t, 0].item()


def test_layer_schedules_follow_each_familys_rule():
    assert moe_layer_schedule(6, decoder_sparse_step=2, mlp_only_layers=[3]) == (
        False, True, False, False, False, True,
    )  # fmt: skip
    assert moe_layer_schedule(5, first_k_dense_replace=2) == (False, False, True, True, True)
    assert moe_layer_schedule(6, first_k_dense_replace=1, moe_layer_freq=2) == (
        False, False, True, False, True, False,
    )  # fmt: skip
    from transformers import Qwen2MoeConfig, Qwen2MoeModel

    cfg = Qwen2MoeConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, moe_intermediate_size=8, vocab_size=32,
        shared_expert_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3, 4],
    )  # fmt: skip
    hf = [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in Qwen2MoeModel(cfg).layers
    ]
    assert moe_layer_schedule(6, decoder_sparse_step=2, mlp_only_layers=[3, 4]) == tuple(hf)


def load_block(block: torch.nn.Module, state: dict, renames: dict[str, str]) -> None:
    """Load an HF MoE module's state dict into our block (the model loader's mapping)."""
    from sglite.layers.linear import loader_of

    params = dict(block.named_parameters())
    filled = set()
    for name, tensor in state.items():
        name = ".".join(renames.get(p, p) for p in name.split("."))
        target = expert_target(name)
        if target is None:
            target = (name, None)
            for ours, theirs, shard in STACKED_GATE_UP:
                if f".{theirs}." in f".{name}":
                    target = (name.replace(theirs, ours), shard)
        param = params[target[0]]
        loader_of(param)(param, tensor, target[1])
        filled.add(target[0])
    assert filled == set(params), f"unfilled: {set(params) - filled}"


def _deepseek(version: int):
    import transformers

    common = dict(
        hidden_size=H, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
        routed_scaling_factor=2.5, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
    )  # fmt: skip
    if version == 2:
        cfg = transformers.DeepseekV2Config(**common, topk_method="group_limited_greedy")
        hf = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(cfg)
    else:
        cfg = transformers.DeepseekV3Config(**common, norm_topk_prob=True)
        hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
    cfg.architectures = [f"DeepseekV{version}ForCausalLM"]
    return cfg, hf


@pytest.mark.parametrize("version", [2, 3])
def test_deepseek_moe_block_matches_transformers(version):
    from sglite.models.decoder_spec import ConfigFields
    from sglite.models.model_config import ModelConfig
    from sglite.models.moe_lm import deepseek_moe_spec

    cfg, hf = _deepseek(version)
    defaults = {} if version == 2 else dict(topk_method="noaux_tc", scoring_func="sigmoid")
    spec = deepseek_moe_spec(ConfigFields(ModelConfig.from_hf(cfg)), **defaults)
    assert spec.sparse_layers == (False, True, True)
    assert spec.router.correction_bias == (version == 3) and spec.router.grouped
    _randomize(hf, 8)
    block = SparseMoeBlock(spec, H, dtype=torch.float32)
    load_block(block, hf.state_dict(), {"shared_experts": "shared_expert"})
    x = torch.randn(1, 50, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = hf(x)[0]
    torch.testing.assert_close(block(x[0]), want, atol=1e-5, rtol=0)


GPT_OSS_LIMIT = 1.0  # low enough that the clamps bite on these weights


def _gpt_oss_spec(num_experts: int = 8) -> MoESpec:
    return MoESpec(
        RouterSpec(num_experts, 2, softmax_after_topk=True, bias=True),
        ExpertsSpec(
            num_experts, 32, act="clamped_swiglu", swiglu_limit=GPT_OSS_LIMIT, bias=True,
            fused_form="gpt_oss",
        ),
    )  # fmt: skip


def test_gpt_oss_mlp_matches_transformers():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        swiglu_limit=GPT_OSS_LIMIT,
    )  # fmt: skip
    hf = GptOssMLP(cfg)
    _randomize(hf, 10)
    block = SparseMoeBlock(_gpt_oss_spec(), H, dtype=torch.float32)
    load_block(block, hf.state_dict(), {"router": "gate"})
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        want = hf(x)[0][0]
        gate_up = x[0] @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > GPT_OSS_LIMIT).float().mean() > 0.1, "the clamp never applies"
    torch.testing.assert_close(block(x[0]), want, atol=1e-5, rtol=0)


class RankView(TPGroup):
    """Rank `rank` of `size` without a process group: its all-reduce returns the partial
    sum, which the test adds up over the ranks."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _qwen2_like_spec() -> MoESpec:
    return MoESpec(
        RouterSpec(8, 2),
        ExpertsSpec(8, 32),
        shared=SharedExpertSpec(48, gated=True),
    )


@pytest.mark.parametrize("spec_name", ["qwen2_like", "gpt_oss"])
@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2), (4, 2), (4, 4)])
def test_rank_shards_sum_to_the_whole_block(spec_name, tp, ep):
    spec = _qwen2_like_spec() if spec_name == "qwen2_like" else _gpt_oss_spec()
    whole = SparseMoeBlock(spec, H, dtype=torch.float32)
    _randomize(whole, 12)
    state = whole.state_dict()
    # the checkpoint's per-expert form, as the model loader sees it
    ckpt = {k: v for k, v in state.items() if ".w13_" not in k and ".w2_" not in k}
    for e in range(spec.experts.num_experts):
        gate, up = state["experts.w13_weight"][e].chunk(2)
        ckpt[f"experts.{e}.gate_proj.weight"], ckpt[f"experts.{e}.up_proj.weight"] = gate, up
        ckpt[f"experts.{e}.down_proj.weight"] = state["experts.w2_weight"][e]
        if spec.experts.bias:
            gate_b, up_b = state["experts.w13_bias"][e].chunk(2)
            ckpt[f"experts.{e}.gate_proj.bias"], ckpt[f"experts.{e}.up_proj.bias"] = gate_b, up_b
            ckpt[f"experts.{e}.down_proj.bias"] = state["experts.w2_bias"][e]
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(13))
    total = torch.zeros(33, H)
    held = []
    for rank in range(tp):
        part = SparseMoeBlock(spec, H, dtype=torch.float32, tp_group=RankView(tp, rank), ep_size=ep)
        load_block(part, ckpt, {})  # the fused shared gate_up_proj splits in its loader
        s = part.experts.shard
        held.append((s.expert_start, s.num_local, s.inter_start, s.inter_size))
        total += part(x)
    torch.testing.assert_close(total, whole(x), atol=1e-5, rtol=0)
    experts_per_rank = 8 // ep
    assert held[-1][:2] == (8 - experts_per_rank, experts_per_rank)
    assert held[-1][3] == 32 * ep // tp


def test_expert_tensor_of_the_wrong_shape_is_a_named_error():
    experts = FusedExperts(ExpertsSpec(4, 32), H, dtype=torch.float32)
    with pytest.raises(ValueError, match="expert 2 up_proj: .* moe_intermediate_size=32"):
        experts.w13_weight.weight_loader(experts.w13_weight, torch.zeros(16, H), (2, "up"))
    with pytest.raises(ValueError, match="expert 1 down_proj: checkpoint tensor has shape"):
        experts.w2_weight.weight_loader(experts.w2_weight, torch.zeros(H + 1, 32), (1, "down"))
