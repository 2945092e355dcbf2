"""DeepSeek-V2 and V3 with their mixture-of-experts layers match transformers.

Tiny random checkpoints (the latent attention of tests/fixtures/tiny_families.py, 3 layers,
the first dense, then MoE layers of 8 experts of width 32 in 4 groups, top-2 from the 2 best
groups, one shared expert): V2 with softmax scores and `group_limited_greedy`
(`routed_scaling_factor` 1.5); V3 with sigmoid scores, `noaux_tc` and a random
`e_score_correction_bias` (it changes which experts tokens choose: checked),
`norm_topk_prob`, yarn rope. On scrambled slots at page sizes 1 and 16: one-shot and chunked
prefill logits within 1e-4 of transformers', a warm prefix's too, and greedy decoding gives
transformers.generate's tokens and logits. The real scheduler gives transformers' greedy
tokens on both (tree core, loop, page size) pairs of values; `--tp-size 2` (gloo, spawned
ranks) equals tp 1 (tests/test_expert_parallel.py, with `--ep-size`). Routing options a
version does not run are refused by name.
"""

from __future__ import annotations

import functools

import pytest
import torch

import test_scheduler_model as sched_model
from fixtures.backends import load_backend
from fixtures.model_checks import (
    check_chunked,
    check_greedy,
    check_one_shot,
    check_scheduler_tokens,
    check_warm_prefix,
    fragmented_runner,
    hf_checked_greedy,
    hf_routes,
)
from fixtures.model_driver import Driver, hf_greedy

_MOE = dict(
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
)
CASES = {
    "v2": (
        "deepseek_v2",
        dict(
            seed=4, config=dict(_MOE, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
        ),
    ),
    "v3": (
        "deepseek_v3",
        dict(seed=5, config=dict(_MOE, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ),
}
ATOL = 1e-4
PROMPT = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(0)).tolist()
CHUNKS = (13, 29)
STEPS = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return lambda name: tiny_model_dir(CASES[name][0], **CASES[name][1])


@pytest.fixture(scope="module")
def hf_ref(tiny_hf_model):
    """(prompt logits, greedy tokens, their logits) of transformers, per case."""
    return functools.cache(
        lambda name: hf_checked_greedy(
            tiny_hf_model(CASES[name][0], **CASES[name][1]), PROMPT, STEPS
        )
    )


@pytest.fixture(scope="module")
def runner(model_dir):
    return functools.cache(lambda name, page_size: fragmented_runner(model_dir(name), page_size))


def _routes(hf) -> list[torch.Tensor]:
    """The experts each sparse layer's router chose for PROMPT's tokens."""
    return [ids.sort(dim=-1).values for ids in hf_routes(hf, PROMPT)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_routing_sends_tokens_to_many_experts(name, tiny_hf_model):
    """The premise: the routers spread tokens, and V3's correction bias changes choices."""
    hf = tiny_hf_model(CASES[name][0], **CASES[name][1])
    routes = _routes(hf)
    assert len(routes) == 2  # layers 1 and 2
    pairs = [len({tuple(row) for row in ids.tolist()}) for ids in routes]
    assert min(pairs) >= 4 and max(pairs) >= 10, f"expert pairs per sparse layer: {pairs}"
    if name == "v3":
        gates = [m for n, m in hf.named_modules() if n.endswith("mlp.gate")]
        saved = [g.e_score_correction_bias.clone() for g in gates]
        assert all(b.abs().min() > 0 for b in saved)
        try:
            for g in gates:
                g.e_score_correction_bias.zero_()
            unbiased = _routes(hf)
        finally:
            for g, b in zip(gates, saved):
                g.e_score_correction_bias.copy_(b)
        changed = [int((a != b).any(-1).sum()) for a, b in zip(routes, unbiased)]
        assert min(changed) >= 4, f"tokens whose experts the bias changed: {changed}"


def test_the_models_have_the_parts_under_test(runner):
    from sglite.layers.moe import SparseMoeBlock

    for name in CASES:
        layers = runner(name, 1).model.model.layers
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True, True]
        block = layers[1].mlp
        assert block.shared_expert is not None and block.shared_expert_gate is None
        spec = block.gate.spec
        assert spec.grouped and (spec.num_groups, spec.topk_groups) == (4, 2) and spec.fp32_gate
        v3 = name == "v3"
        assert spec.scoring == ("sigmoid" if v3 else "softmax")
        assert spec.group_score == ("top2_sum" if v3 else "max")
        assert spec.correction_bias == v3 and spec.renormalize == v3
        assert spec.scaling_factor == (2.5 if v3 else 1.5)
        assert runner(name, 1).kv_pool.values_in_keys  # the latent pool


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_one_shot_chunked_and_warm_match_transformers(name, page_size, runner, hf_ref):
    driver, ref = Driver(runner(name, page_size)), hf_ref(name)[0]
    cold = check_one_shot(driver, PROMPT, ref, ATOL)
    check_chunked(driver, PROMPT, ref, CHUNKS, ATOL)
    check_warm_prefix(driver, cold, PROMPT, ref, page_size, ATOL)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_decode_matches_transformers(name, page_size, runner, hf_ref):
    _, expected, ref_logits = hf_ref(name)
    check_greedy(Driver(runner(name, page_size)), PROMPT, STEPS, expected, ref_logits, ATOL)


# Each model on both tree cores, both loops and both page sizes, in four runs.
SCHEDULER_MATRIX = [
    ("v2", "python", False, 1),
    ("v3", "rust", True, 1),
    ("v3", "python", True, 16),
    ("v2", "rust", False, 16),
]


@pytest.fixture(scope="module")
def sched_reference(model_dir, tiny_hf_model):
    """A short cut of tests/test_scheduler_model.py's workload and transformers' tokens."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf = tiny_hf_model(CASES[name][0], **CASES[name][1])
            workload = sched_model.make_workload(hf.config.vocab_size, seed=2)[:8]
            reqs = [(rid, prompt, min(n, 8)) for rid, prompt, n in workload]
            with torch.no_grad():
                expected = {rid: hf_greedy(hf, prompt, n)[0] for rid, prompt, n in reqs}
            cache[name] = reqs, expected
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("name", "core_name", "overlap", "page_size"),
    SCHEDULER_MATRIX,
    ids=[f"{n}-{c}-{'overlap' if o else 'normal'}-page{p}" for n, c, o, p in SCHEDULER_MATRIX],
)
def test_scheduler_gives_transformers_tokens(
    name, core_name, overlap, page_size, model_dir, sched_reference
):
    reqs, expected = sched_reference(name)
    got, sched = sched_model.run_engine(
        load_backend(core_name), model_dir(name), reqs, page_size=page_size, policy="lpm",
        overlap=overlap, total_tokens=240,
    )  # fmt: skip
    check_scheduler_tokens(got, sched, reqs, expected, evict=True)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("arch", "fields", "named"),
    [
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
        ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
        ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True"),
        ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method='group_limited"),
        ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
        ("deepseek_v2", dict(n_group=3), "n_group=3 does not divide num_experts=8"),
    ],
)
def test_routing_options_not_run_are_refused_by_name(arch, fields, named):
    from fixtures.tiny_models import tiny_config
    from sglite.models.model_config import ModelConfig
    from sglite.models.registry import get_model_class

    method = "group_limited_greedy" if arch == "deepseek_v2" else "noaux_tc"
    cfg = tiny_config(arch, config={**_MOE, "topk_method": method, **fields})
    config = ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match=r"DeepseekV\dForCausalLM: .*" + named.replace("(", r"\(")):
        get_model_class(config.architecture)(config, dtype=torch.float32)
