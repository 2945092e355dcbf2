"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds.

`SamplingBatchInfo.build(params, output_ids, ...)` turns one `SamplingParams` per request and
the tokens generated so far into device tensors; `Sampler()(logits, info)` returns the next
token of every request. Nothing loops over requests on the device side.

Order (as in SGLang): the grammar mask of structured-output rows (disallowed tokens -> -inf;
sglite.constrained.mask), penalties on the raw logits (repetition: positive logits divided by
the penalty, negative ones multiplied, over prompt + output tokens; frequency and presence:
subtracted per occurrence / once, over output tokens), `logit_bias`, the `min_new_tokens` ban of EOS and
stop tokens, then greedy rows take the argmax, and the other rows divide by their
temperature, softmax, mask with top-k, top-p (smallest set whose mass reaches top_p), min-p
(probability below min_p * max), and sample.

Sampling is an exponential race: token = argmax(p_i / E_i), E_i ~ Exp(1), which draws i
with probability p_i / sum(p) and needs no renormalization. Requests with a seed draw E_i
from a counter-based hash of (seed, number of tokens generated so far, token id), so the
same seed gives the same tokens whatever else is in the batch; the others use torch's RNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglite.constrained.mask import VocabMask, apply_vocab_mask
from sglite.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32, 1.0 on greedy rows
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size when disabled
    min_ps: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # Penalties, None when no request of the batch uses them.
    token_counts: torch.Tensor | None = None  # [B, V] occurrences in the output so far
    frequency_penalties: torch.Tensor | None = None  # [B, 1]
    presence_penalties: torch.Tensor | None = None  # [B, 1]
    seen_tokens: torch.Tensor | None = None  # [B, V] bool, prompt + output
    repetition_penalties: torch.Tensor | None = None  # [B, 1]
    banned_tokens: torch.Tensor | None = None  # [B, V] bool, min_new_tokens not reached
    logit_bias: torch.Tensor | None = None  # [B, V] float32 added to the logits
    # Seeds: the rows that have one, their seeds, and their step counters.
    seeded_rows: torch.Tensor | None = None  # [S] int64
    seeds: torch.Tensor | None = None  # [S] int64
    steps: torch.Tensor | None = None  # [S] int64
    # Structured output: the token mask of the constrained rows (None: no row is constrained).
    vocab_mask: VocabMask | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        output_ids: Sequence[Sequence[int]] | None = None,
        output_lens: Sequence[int] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_mask: VocabMask | None = None,
    ) -> SamplingBatchInfo:
        """`output_ids[i]`: tokens request i generated so far (None: nothing yet); only read
        for penalties. `output_lens[i]`: how many tokens it generated so far (default: the
        lengths of `output_ids`), read for `min_new_tokens` and seeds. `prompt_ids` is only
        read for repetition penalties."""
        device = torch.device(device)
        bs = len(params)
        outputs = output_ids if output_ids is not None else [()] * bs
        # How many tokens each request generated so far; the scheduler passes it separately
        # so that only requests with penalties need their whole history.
        n_out = list(output_lens) if output_lens is not None else [len(o) for o in outputs]
        if len(outputs) != bs:
            raise ValueError(f"{bs} sampling params but {len(outputs)} output histories")
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        fields = dict(
            temperatures=tensor(temps, torch.float32).view(bs, 1),
            top_ps=tensor([p.top_p for p in params], torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            min_ps=tensor([p.min_p for p in params], torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            need_top_k=any(k < vocab_size for k, g in zip(top_ks, greedy) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            vocab_mask=vocab_mask,
        )
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            fields["token_counts"] = _counts(outputs, vocab_size, device)
            fields["frequency_penalties"] = tensor(
                [p.frequency_penalty for p in params], torch.float32
            ).view(bs, 1)
            fields["presence_penalties"] = tensor(
                [p.presence_penalty for p in params], torch.float32
            ).view(bs, 1)
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = prompt_ids if prompt_ids is not None else [()] * bs
            history = [list(a) + list(b) for a, b in zip(prompts, outputs)]
            fields["seen_tokens"] = _counts(history, vocab_size, device) > 0
            fields["repetition_penalties"] = tensor(
                [p.repetition_penalty for p in params], torch.float32
            ).view(bs, 1)
        if any(p.logit_bias for p in params):
            bias = torch.zeros(bs, vocab_size, dtype=torch.float32)
            for i, p in enumerate(params):
                for token, value in zip(p.logit_bias_ids, (p.logit_bias or {}).values()):
                    bias[i, token] = float(value)
            fields["logit_bias"] = bias.to(device)
        banned = [
            (i, list(eos_token_ids) + list(p.stop_token_ids or ()))
            for i, p in enumerate(params)
            if n_out[i] < p.min_new_tokens
        ]
        if banned:
            mask = torch.zeros(bs, vocab_size, dtype=torch.bool)
            for i, ids in banned:
                mask[i, [t for t in ids if t < vocab_size]] = True
            fields["banned_tokens"] = mask.to(device)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        if seeded:
            fields["seeded_rows"] = tensor(seeded, torch.int64)
            fields["seeds"] = tensor([params[i].seed & _MASK32 for i in seeded], torch.int64)
            fields["steps"] = tensor([n_out[i] for i in seeded], torch.int64)
        return cls(**fields)


def _counts(histories: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    bs = len(histories)
    rows = [i for i, h in enumerate(histories) for _ in h]
    cols = [t for h in histories for t in h]
    counts = torch.zeros(bs, vocab_size, dtype=torch.float32)
    if cols:
        ones = torch.ones(len(cols), dtype=torch.float32)
        counts.index_put_((torch.tensor(rows), torch.tensor(cols)), ones, accumulate=True)
    return counts.to(device)


def _mul32(h: torch.Tensor, m: int) -> torch.Tensor:
    """`(h * m) mod 2**32` for 0 <= h < 2**32 without overflowing int64."""
    low, high = h & 0xFFFF, h >> 16
    return (low * m + (((high * m) & 0xFFFF) << 16)) & _MASK32


def _hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise `[S, V]` that depends only on (seed, step, token id)."""
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    h = (
        _mul32(seeds, 0x9E3779B1)[:, None]
        + _mul32(steps, 0x85EBCA77)[:, None]
        + _mul32(token, 0xC2B2AE3D)[None, :]
    ) & _MASK32
    for mul in (0x7FEB352D, 0x846CA68B):  # the "lowbias32" integer finalizer
        h = h ^ (h >> 16)
        h = _mul32(h, mul)
    h = h ^ (h >> 16)
    return (h.to(torch.float64) + 0.5) / 2.0**32


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Next token id of every row, `[B]` int64. `logits` are `[B, V]` float32."""
        if info.vocab_mask is not None:  # grammar first: penalties never revive a banned token
            apply_vocab_mask(logits, info.vocab_mask)
        logits = self.apply_penalties(logits, info)
        if info.all_greedy:
            return logits.argmax(dim=-1)
        probs = self.masked_probs(logits, info)
        noise = torch.empty_like(probs).exponential_()
        if info.seeded_rows is not None:
            uniform = _hash_uniform(info.seeds, info.steps, probs.shape[-1])
            noise[info.seeded_rows] = (-torch.log(uniform)).to(noise.dtype)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(info.is_greedy, logits.argmax(dim=-1), sampled)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if info.seen_tokens is not None:
            penalized = torch.where(
                logits > 0, logits / info.repetition_penalties, logits * info.repetition_penalties
            )
            logits = torch.where(info.seen_tokens, penalized, logits)
        if info.token_counts is not None:
            counts = info.token_counts
            logits = (
                logits
                - counts * info.frequency_penalties
                - (counts > 0).to(logits.dtype) * info.presence_penalties
            )
        if info.logit_bias is not None:
            logits = logits + info.logit_bias
        if info.banned_tokens is not None:
            logits = logits.masked_fill(info.banned_tokens, float("-inf"))
        return logits

    @staticmethod
    def masked_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Temperature-scaled probabilities with the top-k, top-p and min-p masks applied.

        The three masks are computed on the same (unmasked) distribution and intersected;
        masked entries are 0 and rows are not renormalized. The most likely token always stays.
        """
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if not (info.need_top_k or info.need_top_p):
            if info.need_min_p:
                threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps.unsqueeze(1)
                probs = probs.masked_fill(probs < threshold, 0.0)
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop = rank >= info.top_ks.unsqueeze(1)
        if info.need_top_p:  # keep the smallest prefix whose mass reaches top_p
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= info.top_ps.unsqueeze(1)
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps.unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
