"""PrefillBudget: the admission arithmetic of one prefill batch; pure-Python twin of the Rust core.

One `PrefillBudget` is built per scheduling pass. It does arithmetic only: the scheduler's
PrefillAdder owns the requests, locks each candidate's matched prefix before asking (so the
candidate's own cached tokens are not counted as evictable headroom), and passes the current
`available` = allocator free tokens + tree evictable tokens to every call.

API (same in both backends)
- `PrefillBudget(page_size, rem_input_tokens, rem_chunk_tokens=None, num_mixed_decode_tokens=0)`
  `rem_chunk_tokens=None` turns chunking off. Mixed decode rows are charged up front.
- `reserve_running(remaining_new_tokens, ignore_eos, new_token_ratio) -> int`: charge the
  running batch; each request reserves min(remaining, 4096) tokens, times new_token_ratio
  (floored) unless it ignores EOS. Returns the tokens reserved.
- `state(available) -> int`: the verdict for the next candidate: NO_TOKEN when the memory
  budget is spent, OTHER when the input or chunk budget is, else CONTINUE.
- `add_req(available, prefix_len, extend_len, max_new_tokens) -> (admitted, state, extend_len)`:
  charge a new request: ceil_page(extend) + page_size + min(max_new, 4096). NO_TOKEN if that
  does not fit strictly under the remaining memory, i.e. iff min(max_new, 4096) exceeds the
  limit of `max_new_tokens_limit` with room = available - total_offset (the one admission
  rule, tested before the extend is paged or chunked). With chunking off, a request that
  would reach the input budget is refused (OTHER) unless it is the first. With chunking on,
  a request over the chunk budget is cut so that prefix + extend ends on a page boundary; a
  cut request reserves no decode tokens. On admission `state` is the verdict for the next one.
- `shortfall(available, extend_len, max_new_tokens) -> int`: the tokens `available` lacks for
  add_req to admit that request now by the memory rule (0 when it fits); charges nothing.
  Admission fairness uses it (scheduler/admission.py): how far the refused head is from fitting.
- `whole_life_need(extend_len, max_new_tokens) -> int`: the tokens a request needs free now so
  that its whole life fits beside everything already charged (the starvation fix, see
  scheduler/admission.py): current_offset + ceil_page(extend + max_new) + page_size, plus what
  each running request (from `reserve_running`) and each one charged in this batch can still
  grow while it lives, L = max_new + LIFE_SLACK_STEPS steps: ceil_page(min(remaining, L)) +
  page_size each (a request charged in this batch also its prompt still to come, paged).
  max_new is not clipped here. Charges nothing.
- `add_req_whole_life(available, prefix_len, extend_len, max_new_tokens) -> (admitted, state,
  extend_len)`: admit a request the memory rule refused when whole_life_need <= available; it
  is never cut (a request over the chunk budget, or at the input budget unless first, is
  refused with OTHER) and is charged as add_req charges it. NO_TOKEN when it does not fit.
- `add_chunk(available, prefix_len, remaining_len, max_new_tokens) -> (state, extend_len)`:
  the next slice of the request being chunked; it always progresses. Decode tokens are
  reserved only with the last slice.
- `PrefillBudget.max_new_tokens_limit(capacity, page_size, prompt_len) -> int` (static): the
  largest max_new_tokens with which add_req admits a prompt of `prompt_len` tokens into an idle
  pool of `capacity` tokens (available == capacity, nothing reserved):
  capacity - page_size - prompt_len - 1. Callers treat a limit below 1 as "cannot fit" (it is
  negative when not even the prompt fits); at 4096 or more any max_new_tokens is admitted,
  since add_req clips it. Front ends use it to refuse up front a request that the scheduler
  could never admit (it would wait forever).
- Read-only properties: total_offset, current_offset, rem_input_tokens, rem_chunk_tokens
  (None when off), num_admitted.
"""

from __future__ import annotations

from typing import Any

from sglite.core._arrays import as_index_array, as_int, as_size

CLIP_MAX_NEW_TOKENS = 4096
# Decode steps a request may outlive its max_new_tokens by in the scheduler's view: its finish is
# seen one step late under the overlap loop, and the prefill step itself is one more.
LIFE_SLACK_STEPS = 2


class AddReqResult:
    CONTINUE = 0
    NO_TOKEN = 1
    OTHER = 2


class PrefillBudget:
    """Admission budget of one prefill batch. See the module docstring for the contract."""

    def __init__(
        self,
        page_size: int,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None = None,
        num_mixed_decode_tokens: int = 0,
    ):
        page_size = as_int(page_size, "page_size")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        mixed = as_size(num_mixed_decode_tokens, "num_mixed_decode_tokens")
        self._ps = page_size
        self._rem_input = as_size(rem_input_tokens, "rem_input_tokens") - mixed
        self._rem_chunk = (
            None
            if rem_chunk_tokens is None
            else as_size(rem_chunk_tokens, "rem_chunk_tokens") - mixed
        )
        self._total_offset = mixed
        self._current_offset = mixed
        self._num_admitted = 0
        self._running_remaining: list[int] = []  # remaining_new_tokens of the running batch
        self._charged_future: list[tuple[int, int]] = []  # (prompt to come, max_new) per charge

    # ---------------------------------------------------------------- views
    @property
    def total_offset(self) -> int:
        return self._total_offset

    @property
    def current_offset(self) -> int:
        return self._current_offset

    @property
    def rem_input_tokens(self) -> int:
        return self._rem_input

    @property
    def rem_chunk_tokens(self) -> int | None:
        return self._rem_chunk

    @property
    def num_admitted(self) -> int:
        return self._num_admitted

    # ---------------------------------------------------------------- operations
    @staticmethod
    def max_new_tokens_limit(capacity: int, page_size: int, prompt_len: int) -> int:
        """The largest max_new_tokens add_req admits for a prompt into an idle pool."""
        capacity = as_size(capacity, "capacity")
        page_size = as_int(page_size, "page_size")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        prompt_len = as_size(prompt_len, "prompt_len")
        return _max_new_limit(capacity, prompt_len, page_size)

    def reserve_running(
        self, remaining_new_tokens: Any, ignore_eos: Any, new_token_ratio: float
    ) -> int:
        remaining = as_index_array(remaining_new_tokens, "remaining_new_tokens")
        flags = list(ignore_eos)
        if len(flags) != len(remaining):
            raise ValueError(
                f"remaining_new_tokens and ignore_eos differ in length ({len(remaining)} vs {len(flags)})"
            )
        ratio = float(new_token_ratio)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {ratio}")
        reserved = 0
        for r, exact in zip(remaining.tolist(), flags):
            tokens = min(max(r, 0), CLIP_MAX_NEW_TOKENS)
            reserved += tokens if exact else int(tokens * ratio)
        self._running_remaining += [max(r, 0) for r in remaining.tolist()]
        self._total_offset += reserved
        return reserved

    def state(self, available: int) -> int:
        available = as_size(available, "available")
        if available - self._total_offset <= 0 or available - self._current_offset <= 0:
            return AddReqResult.NO_TOKEN
        if self._rem_input <= 0 or (self._rem_chunk is not None and self._rem_chunk <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def add_req(
        self, available: int, prefix_len: int, extend_len: int, max_new_tokens: int
    ) -> tuple[bool, int, int]:
        available = as_size(available, "available")
        prefix_len = as_size(prefix_len, "prefix_len")
        extend_len = as_size(extend_len, "extend_len")
        if extend_len < 1:
            raise ValueError("extend_len must be >= 1: every admitted request computes a token")
        max_new_full = as_size(max_new_tokens, "max_new_tokens")
        max_new = min(max_new_full, CLIP_MAX_NEW_TOKENS)
        if max_new > _max_new_limit(available - self._total_offset, extend_len, self._ps):
            return False, AddReqResult.NO_TOKEN, 0
        paged = self._ceil_page(extend_len)
        if self._rem_chunk is None or paged <= self._rem_chunk:
            if self._num_admitted > 0 and paged >= self._rem_input:
                return False, AddReqResult.OTHER, 0
            granted = extend_len
        else:
            end = (prefix_len + self._floor_page(self._rem_chunk)) // self._ps * self._ps
            granted = end - prefix_len
            if granted <= 0:
                return False, AddReqResult.OTHER, 0
            max_new = 0
        self._reserve(granted, max_new)
        self._charged_future.append((extend_len - granted, max_new_full))
        return True, self.state(available), granted

    def whole_life_need(self, extend_len: int, max_new_tokens: int) -> int:
        extend_len = as_size(extend_len, "extend_len")
        if extend_len < 1:
            raise ValueError("extend_len must be >= 1: every admitted request computes a token")
        return self._whole_life_need(extend_len, as_size(max_new_tokens, "max_new_tokens"))

    def add_req_whole_life(
        self, available: int, prefix_len: int, extend_len: int, max_new_tokens: int
    ) -> tuple[bool, int, int]:
        available = as_size(available, "available")
        as_size(prefix_len, "prefix_len")
        extend_len = as_size(extend_len, "extend_len")
        if extend_len < 1:
            raise ValueError("extend_len must be >= 1: every admitted request computes a token")
        max_new = as_size(max_new_tokens, "max_new_tokens")
        if self._whole_life_need(extend_len, max_new) > available:
            return False, AddReqResult.NO_TOKEN, 0
        paged = self._ceil_page(extend_len)
        if self._rem_chunk is not None and paged > self._rem_chunk:
            return False, AddReqResult.OTHER, 0  # never cut: its whole prompt runs now
        if self._num_admitted > 0 and paged >= self._rem_input:
            return False, AddReqResult.OTHER, 0
        self._reserve(extend_len, min(max_new, CLIP_MAX_NEW_TOKENS))
        self._charged_future.append((0, max_new))
        return True, self.state(available), extend_len

    def shortfall(self, available: int, extend_len: int, max_new_tokens: int) -> int:
        available = as_size(available, "available")
        extend_len = as_size(extend_len, "extend_len")
        if extend_len < 1:
            raise ValueError("extend_len must be >= 1: every admitted request computes a token")
        max_new = min(as_size(max_new_tokens, "max_new_tokens"), CLIP_MAX_NEW_TOKENS)
        limit = _max_new_limit(available - self._total_offset, extend_len, self._ps)
        return max(max_new - limit, 0)

    def add_chunk(
        self, available: int, prefix_len: int, remaining_len: int, max_new_tokens: int
    ) -> tuple[int, int]:
        available = as_size(available, "available")
        prefix_len = as_size(prefix_len, "prefix_len")
        remaining_len = as_size(remaining_len, "remaining_len")
        if remaining_len < 1:
            raise ValueError("remaining_len must be >= 1")
        if self._rem_chunk is None:
            raise ValueError("add_chunk needs a chunk budget (rem_chunk_tokens is None)")
        max_new_full = as_size(max_new_tokens, "max_new_tokens")
        max_new = min(max_new_full, CLIP_MAX_NEW_TOKENS)
        limit = min(self._rem_chunk, available - self._total_offset)
        if limit <= 0:
            limit = self._rem_chunk
        if remaining_len <= limit:
            granted = remaining_len
        else:
            granted = (prefix_len + limit) // self._ps * self._ps - prefix_len
            if granted <= 0:  # a continuing chunk must progress: fall back to the chunk budget
                granted = min(remaining_len, max(self._floor_page(self._rem_chunk), self._ps))
            max_new = 0
        self._reserve(granted, max_new)
        self._charged_future.append((remaining_len - granted, max_new_full))
        return self.state(available), granted

    # ---------------------------------------------------------------- internals
    def _reserve(self, extend_len: int, max_new: int) -> None:
        paged = self._ceil_page(extend_len)
        immediate = paged + self._ps
        self._total_offset += immediate + max_new
        self._current_offset += immediate
        self._rem_input -= paged
        if self._rem_chunk is not None:
            self._rem_chunk -= paged
        self._num_admitted += 1

    def _whole_life_need(self, extend_len: int, max_new: int) -> int:
        life, ps = max_new + LIFE_SLACK_STEPS, self._ps
        need = self._current_offset + self._ceil_page(extend_len + max_new) + ps
        need += sum(self._ceil_page(min(r, life)) + ps for r in self._running_remaining)
        for pending, new in self._charged_future:
            need += self._ceil_page(pending) + self._ceil_page(min(new, life)) + ps
        return need

    def _ceil_page(self, n: int) -> int:
        return -(-n // self._ps) * self._ps

    def _floor_page(self, n: int) -> int:
        return n // self._ps * self._ps


def _max_new_limit(room: int, extend_len: int, page_size: int) -> int:
    """The admission rule: a request fits iff extend_len + max_new + page_size < room, i.e.
    iff its (clipped) max_new is at most this. The page of slack stands in for rounding the
    extend up to whole pages."""
    return room - extend_len - page_size - 1
