"""Expert parallelism (`--ep-size`) and DeepSeek's MoE models under tensor parallelism.

One spawn of 2 gloo ranks runs the tp_worker workload on: the tiny DeepSeek-V2 and V3 MoE
models of tests/test_model_deepseek_moe.py at `--tp-size 2` (each expert's width split in
half), and `--tp-size 2 --ep-size 2` (each rank 4 whole experts of 8) on DeepSeek-V2 and
Qwen3-MoE: every rank's logits within 1e-4 of the tp-1 runner's, its greedy tokens
transformers'. A rank loaded alone (rank 1 of 2, no group) holds only experts 4..7 and
never reads the other experts' tensors. `--ep-size` that does not divide `--tp-size`, the
experts, or a model without experts is refused naming the flag.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.model_driver import hf_greedy
from fixtures.tp_worker import DECODE_STEPS, PROMPTS, run_tp_ranks, run_workload
from test_model_deepseek_moe import CASES as DEEPSEEK

ATOL = 1e-4
# name -> (tiny arch, its options, runner kwargs, expected (first expert, held, width) on rank 1)
JOBS = {
    "deepseek_v2_tp2": (*DEEPSEEK["v2"], {}, (0, 8, 16)),
    "deepseek_v3_tp2": (*DEEPSEEK["v3"], {}, (0, 8, 16)),
    "deepseek_v2_ep2": (*DEEPSEEK["v2"], {"ep_size": 2}, (4, 4, 32)),
    "qwen3_moe_ep2": ("qwen3_moe", {}, {"ep_size": 2}, (4, 4, 32)),
}


def test_tp2_and_ep2_match_tp1_and_transformers(tmp_path, tiny_model_dir, tiny_hf_model):
    from sglite.model_executor.model_runner import ModelRunner

    paths = {name: tiny_model_dir(arch, **opts) for name, (arch, opts, _, _) in JOBS.items()}
    jobs = [(name, paths[name], JOBS[name][2]) for name in JOBS]
    failures = run_tp_ranks(2, jobs, tmp_path, timeout_s=400)
    assert not failures, "\n".join(failures)
    for name, (arch, opts, _, rank1_experts) in JOBS.items():
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(2)]
        start, held, width = rank1_experts
        assert set(ranks[1]["experts"]) == {rank1_experts}, name
        assert set(ranks[0]["experts"]) == {(start - held if start else 0, held, width)}, name
        tp1 = ModelRunner(paths[name], device="cpu", max_total_tokens=256, max_running_requests=4)
        ref = run_workload(tp1)
        for rank, got in enumerate(ranks):
            for step, (a, b) in enumerate(zip(got["logits"], ref["logits"])):
                err = (a - b).abs().max().item()
                assert err <= ATOL, f"{name} rank {rank} step {step}: logits differ by {err}"
            assert got["tokens"] == ref["tokens"] and got["sampled"] == ranks[0]["sampled"]
        hf = tiny_hf_model(arch, **opts)
        for i, prompt in enumerate(PROMPTS):
            expected, _ = hf_greedy(hf, list(prompt), DECODE_STEPS + 1)
            assert [t[i] for t in ranks[0]["tokens"]] == expected, f"{name} prompt {i}"


def _rank1(size: int = 2):
    from sglite.distributed import TPGroup

    class Rank1(TPGroup):
        rank = 1

    group = Rank1()
    group.size = size
    return group


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_an_ep_rank_holds_and_reads_only_its_experts(arch, tiny_model_dir):
    """Loading alone (rank 1 of tp 2, ep 2, without a group): experts 4..7, whole."""
    from sglite.layers.moe import FusedExperts
    from sglite.models import loader
    from sglite.models.model_config import ModelConfig

    opts = DEEPSEEK["v2"][1] if arch == "deepseek_v2" else {}
    path = tiny_model_dir(arch, **opts)
    read = []

    def iter_weights(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            read.append(name)
            yield name, tensor

    real = loader.iter_weights
    cfg = ModelConfig.from_pretrained(path)
    kw = dict(dtype=torch.float32, device=torch.device("cpu"), tp_group=_rank1())
    loader.iter_weights = iter_weights
    try:
        model = loader.load_model(path, cfg, ep_size=2, **kw)
    finally:
        loader.iter_weights = real
    blocks = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(blocks) == 2
    for experts in blocks:
        assert tuple(experts.w13_weight.shape) == (4, 64, 64)  # 4 experts x (32 + 32) rows
        assert tuple(experts.w2_weight.shape) == (4, 64, 32)
    full = dict(real(path))
    layer = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    up = full[f"model.layers.{layer}.mlp.experts.6.up_proj.weight"]
    torch.testing.assert_close(model.model.layers[layer].mlp.experts.w13_weight[2, 32:], up)
    expert_names = [n for n in full if ".mlp.experts." in n]
    read_experts = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n}
    assert read_experts == {4, 5, 6, 7} and len(read) == len(full) - len(expert_names) // 2


def test_ep_size_is_refused_naming_the_flag(tiny_model_dir):
    from sglite.cli import parse_server_args
    from sglite.config import ServerArgs
    from sglite.models.model_config import ModelConfig
    from sglite.models.registry import get_model_class

    with pytest.raises(ValueError, match=r"^--ep-size: must divide --tp-size 1, got 2"):
        ServerArgs(ep_size=2)
    with pytest.raises(ValueError, match=r"^--ep-size: must divide --tp-size 4, got 3"):
        ServerArgs(tp_size=4, ep_size=3)
    assert parse_server_args(["--tp", "4", "--ep-size", "2"]).ep_size == 2
    assert parse_server_args(["--tp-size", "2", "--expert-parallel-size", "2"]).ep_size == 2

    def build(arch: str, tp: int, ep: int):
        cfg = ModelConfig.from_pretrained(tiny_model_dir(arch))
        get_model_class(cfg.architecture)(cfg, dtype=torch.float32, tp_group=_rank1(tp), ep_size=ep)

    with pytest.raises(ValueError, match=r"--ep-size 3: does not divide .*'s 8 experts"):
        build("qwen3_moe", 3, 3)
    with pytest.raises(ValueError, match=r"--ep-size 2: LlamaForCausalLM has no mixture-of-ex"):
        build("llama", 2, 2)
    with pytest.raises(ValueError, match=r"--ep-size 2: .* experts are 32 wide.*= 64 ranks"):
        build("qwen3_moe", 128, 2)
