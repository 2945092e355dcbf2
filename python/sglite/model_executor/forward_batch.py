"""ForwardBatch: the tensors of one forward pass, and how to build them from CPU-side lists.

Layout (B requests, T tokens in this step, requests in the same order everywhere):

| field                  | shape | meaning                                                   |
|------------------------|-------|-----------------------------------------------------------|
| input_ids              | [T]   | the tokens to run, request after request                  |
| positions              | [T]   | their positions in their request (prefix_len + i)         |
| seq_lens (+ _cpu)      | [B]   | tokens of each request after this step (prefix + new)     |
| extend_prefix_lens     | [B]   | tokens already in the KV cache (extend/mixed only)        |
| extend_seq_lens        | [B]   | new tokens of each request (extend/mixed only)            |
| req_pool_indices       | [B]   | each request's row in `req_to_token_pool`                 |
| out_cache_loc          | [T]   | the KV slot each new token's K/V is written to            |

Invariant the caller (the scheduler) keeps: before `ModelRunner.forward`, row
`req_pool_indices[i]` of `req_to_token_pool.req_to_token` holds the slots of positions
`0 .. seq_lens[i]-1` of request i, i.e. the cached prefix followed by this step's
`out_cache_loc` span. The attention backends read the prefix through that row.

Modes: EXTEND (prefill, maybe over a cached prefix), DECODE (one new token per request),
MIXED (decode rows expressed as 1-token extends inside a prefill batch; the extend path runs
it). The `*_cpu` lists mirror device tensors so that shapes are known without a device sync.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from sglite.attention.base import AttentionBackend
    from sglite.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"

    def is_extend(self) -> bool:
        """EXTEND and MIXED both run the extend path."""
        return self is not ForwardMode.DECODE

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


def _to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type == "cpu":
        return t
    return t.to(device)


@dataclass(eq=False)
class ForwardBatch:
    """One forward pass. The runner sets `attn_backend` before running the model."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    req_pool_indices: torch.Tensor
    out_cache_loc: torch.Tensor
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool
    extend_prefix_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Logits of every input token ([T, vocab]) instead of the last one per request.
    return_all_logits: bool = False
    # Or logits of these rows of the hidden states only (set by the model worker when a
    # request asks for prompt log-probs: see sglite/logprobs.py).
    logits_index: torch.Tensor | None = None
    attn_backend: AttentionBackend | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def extend(
        cls,
        *,
        input_ids: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        req_pool_indices: Sequence[int],
        out_cache_loc: Any,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        mixed: bool = False,
        return_all_logits: bool = False,
    ) -> ForwardBatch:
        """An extend (or mixed) batch; `input_ids[i]` are request i's new tokens (>= 1)."""
        extend_lens = [len(ids) for ids in input_ids]
        if len(prefix_lens) != len(extend_lens) or len(req_pool_indices) != len(extend_lens):
            raise ValueError(
                f"input_ids, prefix_lens and req_pool_indices differ in length "
                f"({len(extend_lens)}, {len(prefix_lens)}, {len(req_pool_indices)})"
            )
        if min(extend_lens, default=0) < 1:
            raise ValueError("every request of an extend batch needs at least one new token")
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        lens = np.asarray(extend_lens, dtype=np.int64)
        num_tokens = int(lens.sum())
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        positions = np.arange(num_tokens, dtype=np.int64) - starts + np.repeat(prefix, lens)
        flat_ids = np.fromiter((t for ids in input_ids for t in ids), np.int64, num_tokens)
        seq_lens = prefix + lens
        device = kv_pool.device
        loc = _as_loc(out_cache_loc, num_tokens, device)
        return cls(
            forward_mode=ForwardMode.MIXED if mixed else ForwardMode.EXTEND,
            input_ids=_to_device(flat_ids, torch.int64, device),
            positions=_to_device(positions, torch.int64, device),
            seq_lens=_to_device(seq_lens, torch.int64, device),
            seq_lens_cpu=seq_lens.tolist(),
            req_pool_indices=_to_device(req_pool_indices, torch.int64, device),
            out_cache_loc=loc,
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
            extend_prefix_lens=_to_device(prefix, torch.int64, device),
            extend_prefix_lens_cpu=prefix.tolist(),
            extend_seq_lens=_to_device(lens, torch.int64, device),
            extend_seq_lens_cpu=extend_lens,
            return_all_logits=return_all_logits,
        )

    @classmethod
    def decode(
        cls,
        *,
        input_ids: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int],
        req_pool_indices: Sequence[int],
        out_cache_loc: Any,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
    ) -> ForwardBatch:
        """A decode batch; `seq_lens` count the new token (its position is seq_len - 1).

        `input_ids` may be a device tensor (the previous step's sampled tokens, no host trip).
        """
        seq = np.asarray(seq_lens, dtype=np.int64)
        if len(seq) != len(req_pool_indices):
            raise ValueError(
                f"seq_lens and req_pool_indices differ in length "
                f"({len(seq)}, {len(req_pool_indices)})"
            )
        if len(seq) and int(seq.min()) < 1:
            raise ValueError("decode seq_lens count the new token and must be >= 1")
        device = kv_pool.device
        if isinstance(input_ids, torch.Tensor):
            ids = input_ids.to(device=device, dtype=torch.int64).reshape(-1)
        else:
            ids = _to_device(input_ids, torch.int64, device)
        if ids.shape[0] != len(seq):
            raise ValueError(f"decode batch has {len(seq)} requests but {ids.shape[0]} input ids")
        return cls(
            forward_mode=ForwardMode.DECODE,
            input_ids=ids,
            positions=_to_device(seq - 1, torch.int64, device),
            seq_lens=_to_device(seq, torch.int64, device),
            seq_lens_cpu=seq.tolist(),
            req_pool_indices=_to_device(req_pool_indices, torch.int64, device),
            out_cache_loc=_as_loc(out_cache_loc, len(seq), device),
            req_to_token_pool=req_to_token_pool,
            kv_pool=kv_pool,
        )


def _as_loc(out_cache_loc: Any, num_tokens: int, device: torch.device) -> torch.Tensor:
    if isinstance(out_cache_loc, torch.Tensor):
        loc = out_cache_loc.to(device=device, dtype=torch.int64).reshape(-1)
    else:
        loc = _to_device(out_cache_loc, torch.int64, device)
    if loc.shape[0] != num_tokens:
        raise ValueError(f"out_cache_loc has {loc.shape[0]} slots for {num_tokens} new tokens")
    return loc
