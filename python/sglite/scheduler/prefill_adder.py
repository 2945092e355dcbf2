"""PrefillAdder: admits waiting requests into one prefill batch through the core's budget math.

The candidate's matched prefix is locked while it is charged, so its own cached tokens are not
counted as evictable headroom; an admitted request keeps that lock (it becomes `lock_node`
when its row is allocated), a refused one gives it back at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglite.mem_cache.cache_manager import CacheManager
from sglite.scheduler.req import Req


@dataclass
class PrefillEntry:
    req: Req
    start: int  # first position computed (the cached prefix ends here)
    end: int  # one past the last position computed

    @property
    def is_last_chunk(self) -> bool:
        return self.end >= self.req.fill_len


class PrefillAdder:
    def __init__(
        self,
        core,
        cache: CacheManager,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        num_mixed_decode_tokens: int = 0,
        whole_life: bool = False,
    ):
        self.core = core
        self.whole_life = whole_life  # admission.py's rule for a request the budget refuses
        self.cache = cache
        self.budget = core.PrefillBudget(
            cache.page_size, max_prefill_tokens, chunked_prefill_size, num_mixed_decode_tokens
        )
        self.budget.reserve_running(
            [r.remaining_new_tokens for r in running],
            [r.sampling_params.ignore_eos for r in running],
            new_token_ratio,
        )
        self.entries: list[PrefillEntry] = []
        self.new_chunked_req: Req | None = None
        self.shortfall = 0  # tokens the last candidate refused for memory lacked
        self.num_whole_life = 0  # admitted by the whole-life rule (the estimate refused them)

    def add_chunked(self, req: Req) -> int:
        """Schedule the next slice of the request being chunked (always progresses)."""
        start = req.kv_len
        state, granted = self.budget.add_chunk(
            self.cache.available_and_evictable(),
            start,
            req.fill_len - start,
            max(req.remaining_new_tokens, 0),
        )
        self._admit(req, start, start + granted)
        return state

    def add_one(self, req: Req) -> int:
        """Try to admit a waiting request whose match is current (`cache.match(req)` since the
        tree last changed); returns the core's verdict for the next one (NO_TOKEN also when
        `req` itself is refused for memory: then `shortfall` says by how many tokens)."""
        self.cache.lock(req.match_node)
        self.cache.load_back(req)  # HiCache: host-hit tokens take device memory, no compute
        available = self.cache.available_and_evictable()
        extend_len, max_new = req.fill_len - req.match_len, max(req.remaining_new_tokens, 0)
        admitted, state, granted = self.budget.add_req(
            available, req.match_len, extend_len, max_new
        )
        if not admitted and state == self.core.AddReqResult.NO_TOKEN and self.whole_life:
            admitted, state, granted = self.budget.add_req_whole_life(
                available, req.match_len, extend_len, max_new
            )
            if not admitted:
                state = self.core.AddReqResult.NO_TOKEN  # refused for memory: report the shortfall
            else:
                self.num_whole_life += 1
        if not admitted:
            if state == self.core.AddReqResult.NO_TOKEN:
                self.shortfall = self.budget.shortfall(available, extend_len, max_new)
            self.cache.unlock(req.match_node)
            return state
        self._admit(req, req.match_len, req.match_len + granted)
        return state

    def _admit(self, req: Req, start: int, end: int) -> None:
        self.entries.append(PrefillEntry(req, start, end))
        if end < req.fill_len:
            self.new_chunked_req = req

    def undo_last(self) -> None:
        """Take back the last admission (its budget charge stays: the pass ends)."""
        e = self.entries.pop()
        if self.new_chunked_req is e.req:
            self.new_chunked_req = None
        self.cache.unlock(e.req.match_node)

    def rollback(self) -> None:
        """Undo the locks of newly admitted requests (their batch could not be allocated)."""
        for e in self.entries:
            if e.req.row is None:
                self.cache.unlock(e.req.match_node)
