"""The KV pool's default size on a CPU: from the model's context, not a share of the RAM.

Without `--max-total-tokens` a CPU server holds `max(CPU_KV_CONTEXTS x context_len,
CPU_KV_MIN_TOKENS)` tokens: two full-context requests, or many short ones (the 16,384 tokens
llama-server's `-c 16384` shares among its slots). A share of the RAM instead gave a 135M
model a 2 GiB pool (46,602 float32 tokens) that a small server never fills. The pool never
exceeds `min(CPU_KV_BUDGET_BYTES, RAM / 4)`, so it holds one full-context request whenever
that budget can. The chosen size and why go to the start-up log.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_KV_MIN_TOKENS = 16384
CPU_KV_CONTEXTS = 2  # full-context requests the default pool holds
CPU_KV_BUDGET_BYTES = 2 << 30
MAX_DEFAULT_SLOTS = 1 << 20


@dataclass(frozen=True)
class KVSize:
    """A default pool size in tokens (a multiple of the page size) and the reason, for the log."""

    num_slots: int
    reason: str


def kv_slots_for_budget(budget_bytes: int, bytes_per_slot: int, page_size: int) -> int:
    """How many slots (a multiple of page_size, one page kept for padding) fit in a budget."""
    num_slots = budget_bytes // bytes_per_slot - page_size
    return max(0, num_slots // page_size * page_size)


def default_cpu_kv_size(
    context_len: int, bytes_per_slot: int, page_size: int, ram_bytes: int
) -> KVSize:
    """The CPU pool without --max-total-tokens (see the module docstring)."""
    budget = min(CPU_KV_BUDGET_BYTES, ram_bytes // 4)
    cap = min(kv_slots_for_budget(budget, bytes_per_slot, page_size), MAX_DEFAULT_SLOTS)
    want = max(CPU_KV_CONTEXTS * context_len, CPU_KV_MIN_TOKENS)
    want = -(-want // page_size) * page_size
    rule = (
        f"max({CPU_KV_CONTEXTS} x the {context_len}-token context, {CPU_KV_MIN_TOKENS}) "
        f"= {want} tokens"
    )
    if want <= cap:
        return KVSize(want, f"{rule}; --max-total-tokens sets another size")
    why = f"{rule}, capped at min({_gib(CPU_KV_BUDGET_BYTES)}, RAM/4) = {_gib(budget)}"
    if cap < context_len:
        why += f", less than one full-context request ({context_len} tokens)"
    return KVSize(cap, f"{why}; --max-total-tokens sets another size")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
