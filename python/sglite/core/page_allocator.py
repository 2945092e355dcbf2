"""PageAllocator: which KV pages are free; pure-Python twin of the Rust core.

Contract (the Rust core behaves the same, down to the order slots are handed out)
- `num_slots` usable slots make `num_slots // page_size` pages, numbered 1..num_pages; page 0
  (slots 0..page_size-1) is reserved as a padding target, so the KV tensors need
  `num_slots + page_size` rows. Slot s lives in page s // page_size.
- Free pages form a FIFO queue: `alloc` takes from the head, `free` appends to the tail the
  distinct pages of the given slots in ascending page order.
- `alloc(n)` (n a multiple of page_size), `alloc_extend` and `alloc_decode` return None and
  change nothing when there are not enough free pages; they never return a partial result.
- `alloc_extend` and `alloc_decode` also return None, after validating their arguments (a bad
  argument raises ValueError first) and before taking any page, when some request's seq_len
  exceeds `capacity()`: every position of a request has its own slot, so such a request can
  never be held, however few new pages it would need on top of its prefix.
- `free` of a slot in page 0, outside the pool, or in a page that is already free (or already
  staged in the current free group) raises ValueError and changes nothing.
- Between `free_group_begin()` and `free_group_end()` frees are validated and staged; they
  become available, in staging order, at `free_group_end()`. Nesting raises RuntimeError.

Page-continuing allocation, for request i with prefix p, sequence length s (p <= s) and
`last_locs[i]` the slot of token p-1 (-1 when p == 0):
  1. the partial last page is continued: min(s, ceil_page(p)) - p slots at last_loc+1, ...;
  2. the rest, s - max(p, that), comes from new pages taken in request order.
Requests need ceil(s / P) - ceil(p / P) new pages. `alloc_decode(seq_lens, last_locs)` is
`alloc_extend(seq_lens - 1, seq_lens, last_locs)`: seq_lens count the new token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglite.core._arrays import EMPTY, as_index_array, as_int, as_size


class PageAllocator:
    """Free-page bookkeeping of the KV pool. See the module docstring for the contract."""

    def __init__(self, num_slots: int, page_size: int = 1):
        page_size = as_int(page_size, "page_size")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        num_slots = as_size(num_slots, "num_slots")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # the FIFO of free pages is a ring: alloc and free cost only the pages they move
        self._ring = np.arange(1, self.num_pages + 1, dtype=np.int64)
        self._head = 0
        self._num_free = self.num_pages
        self._is_free = np.ones(self.num_pages + 1, dtype=bool)
        self._is_free[0] = False
        self._staged: list[np.ndarray] | None = None
        self._is_staged = np.zeros(self.num_pages + 1, dtype=bool)

    def capacity(self) -> int:
        """Usable slots (whole pages only)."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return self._num_free * self.page_size

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        num_tokens = as_size(num_tokens, "num_tokens")
        if num_tokens % self.page_size:
            raise ValueError(
                f"alloc({num_tokens}) is not a multiple of page_size {self.page_size}; "
                "use alloc_extend for partial pages"
            )
        pages = self._take(num_tokens // self.page_size)
        return None if pages is None else self._page_slots(pages)

    def free(self, slots: Any) -> None:
        arr = as_index_array(slots, "slots")
        if len(arr) == 0:
            return
        ps = self.page_size
        bad = (arr < ps) | (arr >= (self.num_pages + 1) * ps)
        if bad.any():
            raise ValueError(
                f"slot {int(arr[bad][0])} is not in the pool (valid slots: {ps}.."
                f"{(self.num_pages + 1) * ps - 1})"
            )
        pages = np.unique(arr // ps)
        twice = self._is_free[pages] | self._is_staged[pages]
        if twice.any():
            raise ValueError(f"double free of page {int(pages[twice][0])} (slot page_size={ps})")
        if self._staged is not None:
            self._is_staged[pages] = True
            self._staged.append(pages)
            return
        self._release(pages)

    def free_group_begin(self) -> None:
        if self._staged is not None:
            raise RuntimeError("free_group_begin() called twice without free_group_end()")
        self._staged = []

    def free_group_end(self) -> None:
        if self._staged is None:
            raise RuntimeError("free_group_end() called without free_group_begin()")
        staged, self._staged = self._staged, None
        if staged:
            pages = np.concatenate(staged)
            self._is_staged[pages] = False
            self._release(pages)

    def alloc_extend(self, prefix_lens: Any, seq_lens: Any, last_locs: Any) -> np.ndarray | None:
        prefix = as_index_array(prefix_lens, "prefix_lens")
        seq = as_index_array(seq_lens, "seq_lens")
        last = as_index_array(last_locs, "last_locs")
        if not len(prefix) == len(seq) == len(last):
            raise ValueError(
                f"prefix_lens, seq_lens and last_locs differ in length "
                f"({len(prefix)}, {len(seq)}, {len(last)})"
            )
        ps = self.page_size
        for i in range(len(prefix)):
            self._check_request(i, int(prefix[i]), int(seq[i]), int(last[i]))
        if int(seq.max(initial=0)) > self.capacity():
            return None  # more than the pool could ever hold
        need = -(-seq // ps) - -(-prefix // ps)
        pages = self._take(int(need.sum()))
        if pages is None:
            return None
        out: list[np.ndarray] = []
        page_pos = 0
        for i in range(len(prefix)):
            p, s = int(prefix[i]), int(seq[i])
            n1 = min(s, -(-p // ps) * ps) - p
            if n1:
                out.append(np.arange(last[i] + 1, last[i] + 1 + n1, dtype=np.int64))
            k = int(need[i])
            if k:
                fresh = self._page_slots(pages[page_pos : page_pos + k])
                out.append(fresh[: s - p - n1])
                page_pos += k
        return np.concatenate(out) if out else EMPTY.copy()

    def alloc_decode(self, seq_lens: Any, last_locs: Any) -> np.ndarray | None:
        seq = as_index_array(seq_lens, "seq_lens")
        if len(seq) and int(seq.min()) < 1:
            raise ValueError("seq_lens of alloc_decode count the new token and must be >= 1")
        return self.alloc_extend(seq - 1, seq, last_locs)

    # ---------------------------------------------------------------- internals
    def _check_request(self, i: int, p: int, s: int, last: int) -> None:
        ps = self.page_size
        if p < 0 or s < p:
            raise ValueError(f"request {i}: need 0 <= prefix_len <= seq_len, got {p} and {s}")
        if p % ps == 0 or s == p:
            return
        if not ps <= last < (self.num_pages + 1) * ps or (last + 1) % ps != p % ps:
            raise ValueError(
                f"request {i}: last_locs={last} does not end a partial page of prefix_len={p} "
                f"(page_size {ps})"
            )
        if self._is_free[last // ps]:
            raise ValueError(f"request {i}: last_locs={last} lies in a free page")

    def _take(self, num_pages: int) -> np.ndarray | None:
        if num_pages > self._num_free:
            return None
        idx = (self._head + np.arange(num_pages)) % max(self.num_pages, 1)
        pages = self._ring[idx]
        self._head = (self._head + num_pages) % max(self.num_pages, 1)
        self._num_free -= num_pages
        self._is_free[pages] = False
        return pages

    def _release(self, pages: np.ndarray) -> None:
        self._is_free[pages] = True
        tail = self._head + self._num_free
        self._ring[(tail + np.arange(len(pages))) % self.num_pages] = pages
        self._num_free += len(pages)

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        ps = self.page_size
        if ps == 1:
            return pages.copy()
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()
