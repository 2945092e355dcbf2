"""The xgrammar backend: JSON Schema, regex and EBNF grammars compiled for the model's vocabulary.

xgrammar is imported on first use (the edge check or the first compile), never at import time,
so a server that sees no structured-output request does not pay for it. The tokenizer info and
the compiler are built once, lazily, by the first compile.

JSON is generated without free whitespace (`any_whitespace=False`: `{"a": 1, "b": [2, 3]}`,
json.dumps' layout), so a model cannot spend its tokens on blank space; object properties
follow xgrammar's strict mode (no properties beyond the schema's, as OpenAI's `strict`).

Where compiles run: with compile limits (a server: `--grammar-compile-timeout`,
`--grammar-compile-max-memory-mb`) in child processes that are stopped at the deadline or the
memory cap (compile_process.py), the compiled grammar coming back serialized; without (tests,
in-process tools) on the calling thread.
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


def _threads() -> int:
    return max(1, min(MAX_COMPILER_THREADS, os.cpu_count() or 1))


class InProcessCompiles:
    """Compiles on the calling thread (no limits)."""

    def __init__(self, info: Any):
        # our GrammarQueue caches compiled grammars (bounded); xgrammar's own cache would
        # keep every grammar ever seen
        self.compiler = _xgr().GrammarCompiler(info, max_threads=_threads(), cache_enabled=False)

    def compile(self, key: GrammarKey) -> Any:
        kind, text = key
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
        except RuntimeError as e:
            raise problem(key, e) from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def shutdown(self) -> None:
        pass


class IsolatedCompiles:
    """Compiles in child processes (one per concurrent caller), stopped at `timeout_s` or
    `max_memory_bytes` (compile_process.py)."""

    def __init__(self, timeout_s: float, max_memory_bytes: int):
        from sglite.constrained.compile_process import COMPILED_SHARE, CompileProcess

        self.limits = dict(
            timeout_s=timeout_s,
            max_memory_bytes=max_memory_bytes,
            max_compiled_bytes=max_memory_bytes // COMPILED_SHARE,
            max_threads=_threads(),
        )
        first = CompileProcess(None, **self.limits)
        first.spawn()  # it imports xgrammar while `set_info`'s caller builds the TokenizerInfo
        self.info: Any = None
        self.info_json: str | None = None
        self.idle: list = [first]  # CompileProcess objects no caller is using
        self.all: list = [first]
        self.lock = threading.Lock()

    def set_info(self, info: Any) -> None:
        self.info, self.info_json = info, info.serialize_json()
        for proc in self.all:
            proc.init["tokenizer_info"] = self.info_json

    def compile(self, key: GrammarKey) -> Any:
        from sglite.constrained.compile_process import CompileProcess

        with self.lock:
            proc = self.idle.pop() if self.idle else None
            if proc is None:
                proc = CompileProcess(self.info_json, **self.limits)
                self.all.append(proc)
        try:
            status, payload = proc.compile(key)
        finally:
            with self.lock:
                self.idle.append(proc)
        if status == "invalid":
            raise problem(key, RuntimeError(payload))
        return _xgr().CompiledGrammar.deserialize_json(payload, self.info)

    def shutdown(self) -> None:
        with self.lock:
            for proc in self.all:
                proc.close()


class XGrammarBackend(GrammarBackend):
    """`tokenizer`: the HF tokenizer; `vocab_size`: the model's (logits' width); the grammar
    ends with one of `stop_token_ids` (the model's EOS ids). With `compile_timeout_s` and
    `compile_max_memory_mb`, compiles run in child processes under those limits."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        compile_timeout_s: float | None = None,
        compile_max_memory_mb: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.compile_max_memory_mb = compile_max_memory_mb
        self._compiles: InProcessCompiles | IsolatedCompiles | None = None
        self._lock = threading.Lock()

    def check(self, key: GrammarKey) -> None:
        check(key)

    def compiles(self) -> InProcessCompiles | IsolatedCompiles:
        with self._lock:
            if self._compiles is None:
                isolated = None
                if self.compile_timeout_s is not None and self.compile_max_memory_mb is not None:
                    limit = self.compile_max_memory_mb << 20
                    isolated = IsolatedCompiles(self.compile_timeout_s, limit)
                info = _xgr().TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                if isolated is None:
                    self._compiles = InProcessCompiles(info)
                else:
                    isolated.set_info(info)
                    self._compiles = isolated
            return self._compiles

    def compile(self, key: GrammarKey) -> Any:
        return self.compiles().compile(key)

    def matcher(self, compiled: Any) -> Grammar:
        return XGrammarMatcher(_xgr().GrammarMatcher(compiled))

    def compiled_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def shutdown(self) -> None:
        with self._lock:
            if self._compiles is not None:
                self._compiles.shutdown()
