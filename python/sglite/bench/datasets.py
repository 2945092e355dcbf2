"""Benchmark workloads: the per-request records and the seeded datasets that make them.

Per request (RequestResult): TTFT = start to the first chunk with non-empty text; ITL = gaps
between consecutive text chunks (a chunk carrying k tokens is one gap); TPOT = (e2e - TTFT) /
(output tokens - 1), kept apart from ITL.

For generated-shared-prefix, best_prefix_hit_rate is the best rate any cache could reach on
the system prompts: sum over groups of (requests - 1) * system prompt tokens, over all prompt
tokens (the tokenizer's counts); random questions that happen to start alike can push the
measured rate a hair above it on a tiny vocabulary.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class Conversation:
    """One client session: an optional system prompt, then user turns sent one at a time,
    each after the previous answer came back. Single-request datasets have one turn."""

    turns: list[str]
    turn_lens: list[int]  # tokenizer count of each user turn
    output_len: int
    system: str = ""
    system_len: int = 0
    group_idx: int | None = None


@dataclass
class RequestResult:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    conv_idx: int
    turn_idx: int
    group_idx: int | None = None
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of non-empty text
    text: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# ---------------------------------------------------------------------- datasets
class TextMaker:
    """Random text of n tokens: seeded ids, decoded. Text does not always re-tokenize to the
    ids it came from (BPE merges, UTF-8 split over byte tokens), so ids are drawn from the
    tokens that decode to whole characters and re-encode to themselves, and `text` returns
    the text with its re-tokenized length: n, unless cutting and padding did not converge."""

    def __init__(self, tokenizer: Any, rng: random.Random, ids: list[int] | None = None) -> None:
        self.ids = stable_token_ids(tokenizer) if ids is None else ids
        self.tokenizer, self.rng = tokenizer, rng

    def text(self, num_tokens: int) -> tuple[str, int]:
        ids = self.rng.choices(self.ids, k=num_tokens)
        for _ in range(8):  # re-encode, cut or pad, decode: converges to the length in a few
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == num_tokens:
                return text, num_tokens
            ids = ids[:num_tokens] + self.rng.choices(self.ids, k=max(0, num_tokens - len(ids)))
        text = self.tokenizer.decode(ids)
        return text, count_tokens(self.tokenizer, text)


def stable_token_ids(tokenizer: Any) -> list[int]:
    """Non-special ids that decode to whole characters and re-encode to themselves."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    stable = [i for i, t, e in zip(ids, texts, encoded) if e == [i] and "\ufffd" not in t]
    return stable or ids


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def random_dataset(args: argparse.Namespace, maker: TextMaker) -> list[Conversation]:
    def length(top: int) -> int:
        return maker.rng.randint(max(1, int(top * args.random_range_ratio)), top)

    convs = []
    for _ in range(args.num_prompts):
        text, n = maker.text(length(args.random_input_len))
        convs.append(Conversation([text], [n], length(args.random_output_len)))
    return convs


def gsp_dataset(args: argparse.Namespace, maker: TextMaker) -> list[Conversation]:
    """Group by group (all of group 0, then group 1, ...) unless --gsp-shuffle."""
    convs = []
    for g in range(args.gsp_num_groups):
        system, system_len = maker.text(args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            q, q_len = maker.text(args.gsp_question_len)
            convs.append(Conversation([q], [q_len], args.gsp_output_len, system, system_len, g))
    if args.gsp_shuffle:
        maker.rng.shuffle(convs)
    return convs


def multi_turn_dataset(args: argparse.Namespace, maker: TextMaker) -> list[Conversation]:
    convs = []
    for _ in range(args.multi_turn_num_conversations):
        turns = [maker.text(args.multi_turn_input_len) for _ in range(args.multi_turn_turns)]
        convs.append(
            Conversation([t for t, _ in turns], [n for _, n in turns], args.multi_turn_output_len)
        )
    return convs


DATASETS: dict[str, Callable[[argparse.Namespace, TextMaker], list[Conversation]]] = {
    "random": random_dataset,
    "generated-shared-prefix": gsp_dataset,
    "multi-turn": multi_turn_dataset,
}


def best_prefix_hit_rate(convs: Sequence[Conversation]) -> float | None:
    """The hit rate of an unbounded prefix cache: every request after its group's first
    finds the group's system prompt. None when no request belongs to a group."""
    sizes = Counter(c.group_idx for c in convs if c.group_idx is not None)
    system_len = {c.group_idx: c.system_len for c in convs}
    total = sum(c.system_len + sum(c.turn_lens) for c in convs)
    if not sizes or not total:
        return None
    return sum((n - 1) * system_len[g] for g, n in sizes.items()) / total
