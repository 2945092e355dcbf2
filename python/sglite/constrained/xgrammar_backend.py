"""The xgrammar backend: JSON Schema, regex and EBNF grammars compiled for the model's vocabulary.

xgrammar is imported on first use (the edge check or the first compile), never at import time,
so a server that sees no structured-output request does not pay for it. The tokenizer info and
the compiler are built once, lazily, by the first compile.

JSON is generated without free whitespace (`any_whitespace=False`: `{"a": 1, "b": [2, 3]}`,
json.dumps' layout), so a model cannot spend its tokens on blank space; object properties
follow xgrammar's strict mode (no properties beyond the schema's, as OpenAI's `strict`).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from sglite.constrained.base import Grammar, GrammarBackend, GrammarError, GrammarKey

MAX_COMPILER_THREADS = 8
_PROBLEM = {"json_schema": "invalid schema", "regex": "invalid regex", "ebnf": "invalid grammar"}
# xgrammar's messages start with "[12:00:00] /path/file.cc:123: " and sometimes a failed check
_NOISE = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*|Check failed: .*? is false:\s*")


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def problem(key: GrammarKey, error: Exception) -> GrammarError:
    """xgrammar's error as a GrammarError that names the kind: `regex: invalid regex: ...`."""
    lines = [ln for ln in str(error).strip().splitlines() if ln.strip()]
    text = _NOISE.sub("", lines[0] if lines else type(error).__name__).strip()
    return GrammarError(f"{key[0]}: {_PROBLEM.get(key[0], 'invalid')}: {text}")


def check(key: GrammarKey) -> None:
    """Parse the grammar without a vocabulary (cheap); GrammarError when it is invalid."""
    kind, text = key
    g = _xgr().Grammar
    try:
        if kind == "json_schema":
            g.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            g.from_regex(text)
        elif kind == "ebnf":
            g.from_ebnf(text)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    except RuntimeError as e:
        raise problem(key, e) from None


class XGrammarMatcher(Grammar):
    def __init__(self, matcher: Any):
        super().__init__()
        self.m = matcher

    @property
    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def fill_mask(self, bitmask, row: int) -> None:
        if self.m.is_terminated():  # xgrammar refuses to fill then; the row is dropped anyway
            bitmask[row].fill_(-1)
        else:
            self.m.fill_next_token_bitmask(bitmask, row)

    def _accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def _rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    """`tokenizer`: the HF tokenizer; `vocab_size`: the model's (logits' width); the grammar
    ends with one of `stop_token_ids` (the model's EOS ids)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def check(self, key: GrammarKey) -> None:
        check(key)

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                threads = max(1, min(MAX_COMPILER_THREADS, os.cpu_count() or 1))
                # our GrammarQueue caches compiled grammars (bounded); xgrammar's own cache
                # would keep every grammar ever seen
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def compile(self, key: GrammarKey) -> Any:
        kind, text = key
        compiler = self.compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except RuntimeError as e:
            raise problem(key, e) from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: Any) -> Grammar:
        return XGrammarMatcher(_xgr().GrammarMatcher(compiled))
