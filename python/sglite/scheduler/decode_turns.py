"""DecodeTurns: decode rounds owed to the running batch after prefills (two SGLang knobs).

- `--prefill-decode-interval N`: after a prefill batch, the next N rounds schedule no prefill.
- `--max-consecutive-prefill-batches k`: after k prefill batches in a row, one decode batch.
Both only defer a prefill while some request can decode (an idle batch never waits), so each
owes at most N (or 1) decode rounds per prefill: a prefill is never delayed longer than that.
"""

from __future__ import annotations


class DecodeTurns:
    def __init__(self, interval: int, max_consecutive: int):
        self.interval = interval
        self.max_consecutive = max_consecutive
        self.owed = 0  # decode rounds still owed by the interval
        self.consecutive = 0  # prefill batches in a row

    def may_prefill(self, can_decode: bool) -> bool:
        if not can_decode:
            return True
        if self.owed > 0:
            return False
        return not (self.max_consecutive and self.consecutive >= self.max_consecutive)

    def ran(self, is_prefill: bool) -> None:
        """Record the kind of the batch this round launched."""
        if is_prefill:
            self.consecutive += 1
            self.owed = self.interval
        else:
            self.consecutive = 0
            self.owed = max(self.owed - 1, 0)
