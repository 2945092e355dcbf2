"""Which tensor-parallel sizes can split a model, and what one rank holds.

Plain arithmetic, free of torch: the launcher checks `--tp-size` here before any rank starts,
in the main process, which never imports torch (`sglite.distributed` re-exports these).
"""

from __future__ import annotations

__all__ = ["check_tp_size", "local_head_counts", "valid_tp_sizes"]


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """The tp sizes that split this model: they divide the attention heads and the MLP
    width, and either divide the KV heads or are a multiple of them (KV heads replicated)."""
    return [
        t
        for t in range(1, num_heads + 1)
        if num_heads % t == 0
        and intermediate_size % t == 0
        and (num_kv_heads % t == 0 or t % num_kv_heads == 0)
    ]


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise ValueError, naming the sizes that work, when `tp_size` cannot split the model."""
    valid = valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)
    if tp_size in valid:
        return
    if tp_size < 1:
        why = "it must be >= 1"
    elif num_heads % tp_size:
        why = f"the model has {num_heads} attention heads"
    elif intermediate_size % tp_size:
        why = f"the model's MLP width {intermediate_size} is not divisible by it"
    else:
        why = (
            f"the model has {num_kv_heads} KV heads (a tp size must divide them or be a "
            "multiple of them)"
        )
    raise ValueError(
        f"--tp-size {tp_size}: {why}; tp sizes that work: {', '.join(map(str, valid))}"
    )


def local_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on one rank; with fewer KV heads than ranks each rank holds
    the one KV head its query heads read (KV heads replicated over tp_size/num_kv_heads
    ranks)."""
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)
