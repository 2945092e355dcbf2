"""Structured output: the grammar-backend registry (`--grammar-backend`) and the edge check.

Modules: base.py (the backend and matcher interfaces, the null backend), xgrammar_backend.py,
compile_process.py (compiles in child processes, stopped at a deadline or a memory cap),
grammar_queue.py (the scheduler's grammar gate and compile cache), matching.py (the scheduler's
side: constrained rows, accepting tokens), mask.py (the worker's and sampler's side: the token
bitmask). Nothing here imports xgrammar or torch at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from sglite.constrained.base import (
    Grammar,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    NullGrammarBackend,
)

GRAMMAR_BACKENDS = ("xgrammar", "none")
EDGE_CHECK_CACHE_SIZE = 256

__all__ = [
    "GRAMMAR_BACKENDS",
    "Grammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "NullGrammarBackend",
    "create_backend",
    "edge_check",
]


def create_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    *,
    compile_timeout_s: float | None = None,
    compile_max_memory_mb: int | None = None,
) -> GrammarBackend:
    """The backend `name` for a model (`vocab_size`: its logits' width; `stop_token_ids`: its
    EOS ids). Without a tokenizer (in-process tests), grammars are refused. With both compile
    limits, compiles run in child processes stopped at those limits (compile_process.py)."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {GRAMMAR_BACKENDS}")
    if name == "none":
        return NullGrammarBackend()
    if tokenizer is None:
        return NullGrammarBackend("structured output needs the model's tokenizer")
    from sglite.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(
        tokenizer,
        vocab_size,
        stop_token_ids,
        compile_timeout_s=compile_timeout_s,
        compile_max_memory_mb=compile_max_memory_mb,
    )


def edge_check(name: str) -> Callable[[GrammarKey], None]:
    """The check the server runs on a grammar before sending its request (raises GrammarError):
    a syntax check without the vocabulary, the same one the backend's compile starts with.
    Grammars that passed are remembered (a bounded LRU), so repeats cost a lookup."""
    if name == "none":
        return NullGrammarBackend().check
    from sglite.constrained import xgrammar_backend

    return functools.lru_cache(maxsize=EDGE_CHECK_CACHE_SIZE)(xgrammar_backend.check)
