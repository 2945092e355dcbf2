"""The batched sampler: masks and temperatures by their empirical distributions, penalties by
exact values, seeds by determinism across batch compositions."""

from __future__ import annotations

import pytest
import torch

from sglite.model_executor.sampler import Sampler, SamplingBatchInfo
from sglite.sampling_params import SamplingParams

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005])
LOGITS = PROBS.log()
V = len(PROBS)
N = 20000  # samples per distribution test; 4.5 sigma of a frequency is < 0.016


def _info(params, **kw) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(params, vocab_size=kw.pop("vocab_size", V), device="cpu", **kw)


def _frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    torch.manual_seed(0)
    tokens = Sampler()(logits.expand(N, -1).clone(), _info([params] * N))
    return torch.bincount(tokens, minlength=V).float() / N


def _expect(freq: torch.Tensor, kept: list[int], weights: torch.Tensor = PROBS) -> None:
    target = torch.zeros(V)
    target[kept] = weights[kept] / weights[kept].sum()
    assert freq[[i for i in range(V) if i not in kept]].sum() == 0, freq
    torch.testing.assert_close(freq, target, atol=0.016, rtol=0)


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, 0.0, -1.0], [0.0, 0.0, 5.0]])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=1.0, top_k=2, seed=1),
    ]
    info = _info(params, vocab_size=3)
    assert not info.all_greedy
    out = Sampler()(logits, info)
    assert out[:2].tolist() == [1, 0] and out[2].item() in (1, 2)
    assert Sampler()(logits[:2], _info(params[:2], vocab_size=3)).tolist() == [1, 0]


def test_plain_sampling_follows_the_softmax():
    _expect(_frequencies(SamplingParams()), list(range(V)))


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        weights = torch.softmax(LOGITS / temperature, dim=-1)
        _expect(_frequencies(SamplingParams(temperature=temperature)), list(range(V)), weights)


def test_top_k_keeps_the_k_most_likely():
    _expect(_frequencies(SamplingParams(top_k=3)), [0, 1, 2])


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    _expect(_frequencies(SamplingParams(top_p=0.6)), [0, 1])  # 0.40 < 0.6 <= 0.65
    _expect(_frequencies(SamplingParams(top_p=0.35)), [0])
    _expect(_frequencies(SamplingParams(top_p=0.92)), [0, 1, 2, 3, 4])


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    _expect(_frequencies(SamplingParams(min_p=0.3)), [0, 1, 2])  # threshold 0.12
    _expect(_frequencies(SamplingParams(min_p=0.2)), [0, 1, 2, 3])  # threshold 0.08


def test_masks_intersect_and_apply_per_row():
    _expect(_frequencies(SamplingParams(top_k=4, top_p=0.75, min_p=0.1)), [0, 1, 2])
    torch.manual_seed(1)
    params = [SamplingParams(top_k=1 + i % 3) for i in range(3 * 3000)]
    tokens = Sampler()(LOGITS.expand(len(params), -1).clone(), _info(params)).view(-1, 3)
    for col in range(3):
        assert set(tokens[:, col].tolist()) == set(range(col + 1))


def test_masks_use_the_temperature_scaled_distribution():
    weights = torch.softmax(LOGITS / 3.0, dim=-1)  # flatter: 4 tokens to reach 0.6 now
    _expect(_frequencies(SamplingParams(temperature=3.0, top_p=0.6)), [0, 1, 2, 3], weights)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    info = _info(
        [SamplingParams(repetition_penalty=2.0)],
        vocab_size=4,
        prompt_ids=[[0]],
        output_ids=[[1, 1]],
    )
    out = Sampler.apply_penalties(logits, info)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 4)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    info = _info(params, vocab_size=4, prompt_ids=[[3, 3, 3]], output_ids=[[1, 1, 1, 2]])
    out = Sampler.apply_penalties(logits, info)
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0]]


def test_penalties_change_greedy_choice_per_row():
    logits = torch.tensor([[1.0, 0.9], [1.0, 0.9]])
    params = [SamplingParams(temperature=0, presence_penalty=0.5), SamplingParams(temperature=0)]
    info = _info(params, vocab_size=2, output_ids=[[0], [0]])
    assert Sampler()(logits, info).tolist() == [1, 0]


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 2)
    params = [SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[2])] * 2
    info = _info(params, vocab_size=4, output_ids=[[0, 0], [0, 0, 0]], eos_token_ids=[1])
    assert Sampler()(logits, info).tolist() == [3, 1]


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(seed=1234)

    def run(params, outputs, row):
        torch.manual_seed(len(params))  # the unseeded rows differ between runs
        info = SamplingBatchInfo.build(params, vocab_size=50, device="cpu", output_ids=outputs)
        return Sampler()(logits.expand(len(params), -1).clone(), info)[row].item()

    history: list[int] = []
    alone, crowded = [], []
    for _ in range(20):
        alone.append(run([seeded], [history], 0))
        crowded.append(
            run([SamplingParams(), SamplingParams(seed=5), seeded], [[1], [2, 3], history], 2)
        )
        history = history + [alone[-1]]
    assert alone == crowded
    assert len(set(alone)) > 3  # the step counter moves the stream on
    other = [run([SamplingParams(seed=4321)], [[0] * i], 0) for i in range(20)]
    assert other != alone


def test_seeded_sampling_follows_the_distribution():
    params = [SamplingParams(seed=s) for s in range(N)]
    tokens = Sampler()(LOGITS.expand(N, -1).clone(), _info(params))
    _expect(torch.bincount(tokens, minlength=V).float() / N, list(range(V)))


def test_build_checks_history_length():
    with pytest.raises(ValueError, match="2 sampling params but 1 output histories"):
        _info([SamplingParams()] * 2, output_ids=[[1]])


def test_output_lens_drive_seeds_and_min_new_tokens_without_histories():
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    params = [SamplingParams(temperature=0, min_new_tokens=2)]
    assert Sampler()(
        logits, _info(params, vocab_size=3, output_lens=[1], eos_token_ids=[1])
    ).tolist() == [2]
    assert Sampler()(
        logits, _info(params, vocab_size=3, output_lens=[2], eos_token_ids=[1])
    ).tolist() == [1]
    seeded = [SamplingParams(seed=9)]
    logits = torch.zeros(1, 64)
    by_len = Sampler()(logits, _info(seeded, vocab_size=64, output_lens=[5]))
    by_ids = Sampler()(logits, _info(seeded, vocab_size=64, output_ids=[[0] * 5]))
    assert by_len.tolist() == by_ids.tolist()


def test_logit_bias_is_added_per_row():
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0, logit_bias={"2": 5.0}), SamplingParams(temperature=0)]
    info = _info(params, vocab_size=3)
    assert Sampler()(logits, info).tolist() == [2, 1]
    biased = Sampler.apply_penalties(logits, info)
    assert biased[0].tolist() == [0.0, 2.0, 6.0] and biased[1].tolist() == [0.0, 2.0, 1.0]
    banned = SamplingParams(temperature=1.0, logit_bias={"0": -100, "1": -100})
    freq = _frequencies(banned, torch.zeros(V))
    assert freq[:2].sum() == 0  # -100 makes a token practically impossible
