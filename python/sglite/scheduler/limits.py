"""What a request may ask of this scheduler: the model's context and the KV cache's fit rule.

`RequestLimits.refusal(...)` is checked when a request arrives (a 400 naming the limit);
`idle_refusal(...)` is the safety net for a queue head that could not be admitted even into
the idle KV cache (validation should have refused it; it is finished, never retried forever).
The fit rule is the admission budget's own (`PrefillBudget.max_new_tokens_limit`), so a
request accepted here can always be admitted once the cache is idle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    context_length: int
    capacity: int  # usable KV slots (whole pages)
    page_size: int
    core: object  # the tree core (for PrefillBudget.max_new_tokens_limit)

    def refusal(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a new request can never be served, or None."""
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len + max_new_tokens > self.context_length:
            return (
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the context length {self.context_length}"
            )
        limit = self.core.PrefillBudget.max_new_tokens_limit(
            self.capacity, self.page_size, prompt_len
        )
        if max_new_tokens > limit:
            return (
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) can "
                f"never fit in the KV cache ({self.capacity} tokens, page size {self.page_size})"
            )
        return None

    def idle_refusal(self, fill_len: int, max_new_tokens: int) -> str:
        """The message for a queue head that the idle KV cache did not admit."""
        return (
            f"prompt ({fill_len} tokens) + max_new_tokens ({max_new_tokens}) cannot "
            f"be admitted even into the idle KV cache ({self.capacity} tokens, page size "
            f"{self.page_size})"
        )
