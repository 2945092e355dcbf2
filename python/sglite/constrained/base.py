"""The grammar-backend interface (compile a grammar, match tokens against it) and its null twin.

A grammar is named by its key, `(kind, text)` with kind one of `json_schema`, `regex`, `ebnf`
(SamplingParams.grammar_key). A backend checks a key cheaply (no tokenizer: the HTTP edge does
it), compiles it against the model's vocabulary (slow: compile threads do it), and makes a
fresh per-request matcher (`Grammar`) from a compiled grammar.

Token masks are packed bitmasks: int32 rows of `ceil(vocab_size / 32)` words, where bit
`t % 32` of word `t // 32` is set when token t is allowed (xgrammar's layout). `vocab_size` is
the model's (its logits' width), which may exceed the tokenizer's; the padding ids are never
allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GrammarKey = tuple[str, str]


class GrammarError(ValueError):
    """A grammar that cannot be used; the message names it (`json_schema: invalid schema: ...`)
    and becomes the 400's message."""


class Grammar(ABC):
    """One request's matcher: the grammar state after the tokens it accepted.

    Owned by the scheduler: it accepts each processed output token and rolls back discarded
    ones. `fill_mask` may run on the worker thread, but only while the scheduler leaves this
    matcher alone (a batch with a constrained row is launched only once that row's previous
    token is processed, and the row's next token is accepted only after the batch ran).
    """

    def __init__(self) -> None:
        self.num_accepted = 0  # tokens accepted and not rolled back

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar does not allow it."""
        if not self._accept(token):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        num_tokens = min(num_tokens, self.num_accepted)
        if num_tokens > 0:
            self._rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (CPU int32, packed as above).
        A terminated matcher allows every token: its request is finished, so whatever its
        row samples is dropped."""

    @abstractmethod
    def _accept(self, token: int) -> bool: ...

    @abstractmethod
    def _rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(ABC):
    """Compiles grammars for one model's vocabulary; see the module docstring.

    `check` and `compile` are thread-safe (compile threads call `compile` concurrently);
    `matcher` is called by the scheduler thread."""

    name: str

    @abstractmethod
    def check(self, key: GrammarKey) -> None:
        """Raise GrammarError when `key` is not a valid grammar (cheap; no vocabulary)."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of `key` (slow); raise GrammarError when it is invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Grammar:
        """A fresh matcher at the start of `compiled` (a value `compile` returned)."""

    def compiled_bytes(self, compiled: Any) -> int:
        """Memory a compiled grammar holds (the compile cache is bounded by it)."""
        return 0

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop what compiles run on (compile processes)."""


class NullGrammarBackend(GrammarBackend):
    """Structured output disabled: every grammar is refused with `reason`."""

    name = "none"

    def __init__(
        self,
        reason: str = "structured output is disabled on this server (--grammar-backend none)",
    ):
        self.reason = reason

    def check(self, key: GrammarKey) -> None:
        raise GrammarError(f"{key[0]}: {self.reason}")

    def compile(self, key: GrammarKey) -> Any:
        raise GrammarError(f"{key[0]}: {self.reason}")

    def matcher(self, compiled: Any) -> Grammar:
        raise RuntimeError("the null grammar backend compiles nothing")
