"""HeadOfLineGuard: fair admission past a waiting request refused for KV memory.

The whole-life rule (the budget's `add_req_whole_life`, both tree cores). The budget's estimate
can drain while memory is plentiful: a running request reserves min(remaining, 4096) tokens
but holds more KV each step, so with long ignore_eos requests its room falls a token per
running request per step and turns negative long before memory runs out; SGLang then refuses
every candidate until one finishes (a 12,600-token pool, 3 x 5,000-token requests: an 8-token
request waits ~4,000 steps). Here a candidate the estimate refuses is still admitted when its
whole life fits in what is free now (allocator free + evictable):
    need = charged now in this batch + ceil_page(extend + max_new) + page
         + for each running request: ceil_page(min(remaining, L)) + page
         + for each request charged in this batch: its prompt still to come + the same growth
    with L = max_new + 2 steps (its prefill, and the finish the overlap loop sees a step late).
Why it never brings a retraction forward: the candidate decodes at most max_new steps; in that
time nothing present grows by more than what `need` counts, so every decode step of its life
fits without retracting anyone; when it finishes its KV is freed (or becomes evictable), and
the others are exactly where they would be without it. Requests admitted later see it as
running (the estimate reserves its tokens; the rule counts its growth), so they are no more
permissive than they would have been. A "no memory" verdict therefore no longer ends the pass
while --prefill-lookahead-requests > 0; 0 keeps SGLang's rule (and disables this one).

SGLang stops a prefill pass at the first request the budget refuses for memory, so a small
request that would fit waits behind a large one that does not (12 requests that each reserve
4,096 tokens hold an 8-token request for minutes at 2% of the pool in use). Here the pass goes
on, but on terms that keep the refused request from starving:

- The *head* of a pass is the first candidate, in the policy's order, that the budget refuses
  for memory; `shortfall` is how many tokens it lacks (`PrefillBudget.shortfall`, computed with
  its own prefix locked). Later candidates are still tried (at most `--prefill-lookahead-requests`
  of them) while the budget has room left; each one admitted *bypasses* the head.
- A bypasser's *bound* is the most budget room it can ever take: its prompt plus max_new_tokens,
  rounded up to pages, plus one page (its prefix, its own slots, its decode reservation).
- The aging rule: before trying a candidate past the head, the pass stops if the head's
  shortfall is at most the sum of the bounds of its bypassers that still hold KV (admitted in
  earlier passes and not finished, or in this one). So requests that passed the head are
  never the reason it does not fit: as soon as it would fit without them, nothing more passes
  it, and it is admitted once they finish.

Why the head cannot starve (FCFS, the default): newcomers queue behind it, so every request
admitted while it waits is either a bypasser or was ahead of it (admitted earlier, or retracted
back to the front); the latter are finitely many and finish. Once only bypassers run, the head's
shortfall is at most what they hold, which is at most the sum of their bounds, so the rule
stops every later pass at the head until they finish too; then it fits (a request that cannot
fit even into the idle pool is refused with an error instead, see limits.py). Under the other
policies a request sorted ahead of the head may still be admitted before it, as in SGLang.
"""

from __future__ import annotations

from sglite.scheduler.req import Req


class HeadOfLineGuard:
    """Per prefill pass: `start()`, then `may_try()` before each candidate, `refused(req,
    shortfall)` / `admitted(req)` after it; `commit()` once the batch is built."""

    def __init__(self, max_lookahead: int, page_size: int):
        self.max_lookahead = max_lookahead
        self.page_size = page_size
        self.head: Req | None = None
        self.shortfall = 0
        self.num_tried = 0  # candidates tried past the head in this pass
        self.passing: list[Req] = []  # admitted past the head in this pass

    def start(self) -> None:
        self.head, self.shortfall, self.num_tried, self.passing = None, 0, 0, []

    def may_try(self) -> bool:
        """Whether the pass may try one more candidate."""
        head = self.head
        if head is None:
            return True
        if self.num_tried >= self.max_lookahead:
            return False
        head.bypassers = [b for b in head.bypassers if b.row is not None and not b.finished]
        held = sum(self.bound(b) for b in head.bypassers + self.passing)
        if self.shortfall <= held:  # it would fit but for those that passed it: let it go first
            return False
        self.num_tried += 1
        return True

    def refused(self, req: Req, shortfall: int) -> None:
        """The budget refused `req` for memory, `shortfall` tokens short."""
        if self.head is None:
            self.head, self.shortfall = req, shortfall

    def admitted(self, req: Req) -> None:
        if self.head is not None:
            self.passing.append(req)

    def commit(self) -> int:
        """The pass's batch was built: its bypassers hold KV now. Returns their number."""
        if self.head is not None:
            self.head.bypassers += self.passing
        num = len(self.passing)
        self.passing = []
        return num

    def bound(self, req: Req) -> int:
        ps = self.page_size
        return -(-(len(req.input_ids) + req.max_new_tokens) // ps) * ps + ps
