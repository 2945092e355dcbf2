"""Differential tests: the Rust core (sglite._core) behaves exactly like the Python twin.

Hypothesis state machines drive both backends at once with the same random calls and compare
every result (slot arrays, node ids, cached lengths, exception types), run `sanity_check()` on
both after every step, and check the conservation invariant of a cache manager:
free + evictable + protected + held == capacity, where "held" are the slots owned by fake
running requests (matched, locked, allocated, decoded, then inserted with duplicates freed).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import sglite.core as core

POLICIES = ("lru", "lfu", "fifo", "priority")
PY = core.load("python")
_RS = core.load("rust")
RS = _RS if _RS.name == "rust" else None
WHY_NO_RUST = None if RS is not None else core.describe()["reason"]

needs_rust = pytest.mark.skipif(
    RS is None, reason=f"the native core sglite._core is not usable: {WHY_NO_RUST}"
)

# Deterministic in CI; every step runs both backends plus two sanity checks.
PARITY = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_native_core_is_usable_when_required():
    """CI builds the native module; SGL_TEST_REQUIRE_RUST=1 turns its absence into a failure."""
    if RS is None and os.environ.get("SGL_TEST_REQUIRE_RUST") == "1":
        pytest.fail(f"SGL_TEST_REQUIRE_RUST=1 but the native core is unusable: {WHY_NO_RUST}")
    if RS is None:
        pytest.skip(f"the native core is not built ({WHY_NO_RUST})")
    assert RS.__version__ == PY.__version__


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Failed:
    """Both backends raised this exception type."""

    kind: type


def assert_same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{what}: {a!r} vs {b!r}"
        assert a.dtype == np.int64 and b.dtype == np.int64, f"{what}: {a.dtype} vs {b.dtype}"
        assert a.ndim == 1 and b.ndim == 1 and np.array_equal(a, b), f"{what}: {a} vs {b}"
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), f"{what}: {a!r} vs {b!r}"
        for x, y in zip(a, b):
            assert_same(x, y, what)
    else:
        assert isinstance(a, bool) == isinstance(b, bool), f"{what}: {a!r} vs {b!r}"
        assert a == b, f"{what}: python {a!r} vs rust {b!r}"


class Pair:
    """One object per backend; `call` runs a method on both and checks they agree."""

    def __init__(self, py_obj: Any, rs_obj: Any):
        self.py, self.rs = py_obj, rs_obj

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        outcomes = []
        for obj in (self.py, self.rs):
            try:
                outcomes.append(getattr(obj, method)(*args, **kwargs))
            except (ValueError, RuntimeError) as e:
                outcomes.append(Failed(type(e)))
        a, b = outcomes
        what = f"{method}{args}{kwargs or ''}"
        if isinstance(a, Failed) or isinstance(b, Failed):
            assert a == b, f"{what}: python -> {a!r}, rust -> {b!r}"
            return a
        assert_same(a, b, what)
        return a


def both(cls: str, *args: Any) -> Pair:
    assert RS is not None
    return Pair(getattr(PY, cls)(*args), getattr(RS, cls)(*args))


# ---------------------------------------------------------------------------- inputs
# A few fixed token runs over a 4-token alphabet: random cuts of them share prefixes that end
# inside pages and inside nodes, so splits and page-aligned matches happen all the time.
BASES = [np.random.default_rng(seed).integers(0, 4, 96).tolist() for seed in range(2)]
TOKENS = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 96).map(lambda n: 96 - n),  # shrinks towards long shared prefixes
    st.lists(st.integers(0, 3), max_size=20),
)
NAMESPACES = st.sampled_from([None, "", "a", "b"])
DTYPES = st.sampled_from([None, np.int64, np.int32, np.uint32, np.int16, np.uint8])


def as_input(values: list[int] | np.ndarray, dtype: Any) -> Any:
    """The same integers as a list (dtype None) or an array of the given dtype (int64 when
    they do not fit it)."""
    if dtype is None:
        return list(map(int, values))
    arr = np.asarray(values, dtype=np.int64)
    if len(arr) and int(arr.max()) > np.iinfo(dtype).max:
        dtype = np.int64
    return arr.astype(dtype)


@dataclass(eq=False)
class Request:
    tokens: list[int]
    slots: np.ndarray  # one slot per token: [0, own_from) the tree's, the rest its own
    own_from: int
    node: int
    ns: str | None


BAD_TREE_CALLS = [
    ("insert", ([1, 2], [1]), {}),
    ("insert", (np.array([1.0, 2.0]), [1, 2]), {}),
    ("insert", (np.array([[1, 2]]), np.array([[1, 2]])), {}),
    ("insert", ([1], [1]), {"extra_key": 5}),
    ("insert", ([1], [1]), {"priority": 1.5}),
    ("insert", ([True], [1]), {}),
    ("match_prefix", ("abc",), {}),
    ("match_prefix", (None,), {}),
    ("match_prefix", ([1, 2.5],), {}),
    ("match_prefix", (np.zeros((2, 2), dtype=np.int64),), {}),
    ("evict", (-1,), {}),
    ("evict", (1.5,), {}),
    ("evict", (True,), {}),
    ("lock", ("0",), {}),
    ("lock", (-3,), {}),
    ("unlock", (10**9,), {}),
    ("dfs_weight_order", ([0, 10**9],), {}),
]

BAD_ALLOCATOR_CALLS = [
    ("alloc", (-1,), {}),
    ("free", ([0],), {}),
    ("free", ([10**7],), {}),
    ("free", (np.array([1.5]),), {}),
    ("alloc_extend", ([2], [1], [-1]), {}),
    ("alloc_extend", ([0], [1, 2], [-1]), {}),
    ("alloc_decode", ([0], [-1]), {}),
    ("free_group_end", (), {}),
]


# ---------------------------------------------------------------------------- tree + allocator
class TreeCoreParity(RuleBasedStateMachine):
    """A cache manager's life over both backends, with bad calls mixed in."""

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        policy=st.sampled_from(POLICIES),
        num_slots=st.integers(150, 700),
    )
    def setup(self, page_size: int, policy: str, num_slots: int) -> None:
        self.ps = page_size
        self.tree = both("RadixTree", page_size, policy)
        self.alloc = both("PageAllocator", num_slots, page_size)
        self.capacity = self.alloc.call("capacity")
        self.requests: list[Request] = []
        self.loose: list[np.ndarray] = []  # allocated with alloc(), owned by no request
        self.extra_locks: list[int] = []
        self.seen_ids: list[int] = [0]
        self.history: list[tuple[list[int], str | None]] = []  # finished requests, newest first

    # ------------------------------------------------------------ helpers
    def seen(self, node_id: int) -> None:
        if node_id not in self.seen_ids:
            self.seen_ids.append(node_id)

    def free(self, slots: np.ndarray, group: bool = False) -> None:
        if group:
            self.alloc.call("free_group_begin")
        assert not isinstance(self.alloc.call("free", slots), Failed)
        if group:
            self.alloc.call("free_group_end")

    def alloc_or_evict(self, method: str, *args: Any) -> np.ndarray | None:
        """Allocate; when memory is short, evict what is needed (like a cache manager), retry."""
        slots = self.alloc.call(method, *args)
        if slots is None:
            freed = self.tree.call("evict", 2 * self.ps + 64)
            self.free(freed)
            slots = self.alloc.call(method, *args)
        assert not isinstance(slots, Failed)
        return slots

    # ------------------------------------------------------------ requests
    def start(self, tokens: list[int], ns: str | None, dtype: Any) -> None:
        """Match (capped at len - 1), lock, allocate the rest: a running request."""
        if len(tokens) < 2:
            return
        prefix, node = self.tree.call("match_prefix", as_input(tokens[:-1], dtype), extra_key=ns)
        self.seen(node)
        self.tree.call("lock", node)
        own = self.alloc_or_evict("alloc_extend", [len(prefix)], [len(tokens)], [-1])
        if own is None:
            self.tree.call("unlock", node)
            return
        self.requests.append(
            Request(list(tokens), np.concatenate([prefix, own]), len(prefix), node, ns)
        )

    def decode(self, req: Request, token: int) -> None:
        new = self.alloc_or_evict("alloc_decode", [len(req.tokens) + 1], [int(req.slots[-1])])
        if new is not None:
            req.tokens.append(token)
            req.slots = np.concatenate([req.slots, new])

    def finish(self, req: Request, priority: int, abort: bool, dtype: Any) -> None:
        """Insert prompt + output, free the duplicates and the partial page, unlock."""
        self.requests.remove(req)
        if abort:  # retracted or aborted: its KV is freed, not cached
            self.free(req.slots[req.own_from :])
        else:
            tokens, slots = as_input(req.tokens, dtype), as_input(req.slots, dtype)
            cached, node = self.tree.call(
                "insert", tokens, slots, extra_key=req.ns, priority=priority
            )
            self.seen(node)
            assert cached >= req.own_from
            self.history = [(req.tokens, req.ns), *self.history[:15]]
            key_len = len(req.tokens) // self.ps * self.ps
            dup_and_tail = np.concatenate([req.slots[req.own_from : cached], req.slots[key_len:]])
            self.free(dup_and_tail, group=priority % 2 == 0)
        self.tree.call("unlock", req.node)

    @rule(
        batch=st.lists(st.tuples(TOKENS, NAMESPACES), min_size=1, max_size=4),
        decode_steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=6),
        priority=st.integers(-2, 2),
        dtype=DTYPES,
    )
    def serve_batch(self, batch: list, decode_steps: list, priority: int, dtype: Any) -> None:
        """A batch of requests from start to finish, decoding a few tokens in between."""
        first = len(self.requests)
        for tokens, ns in batch:
            self.start(tokens, ns, dtype)
        mine = self.requests[first:]
        for i, token in decode_steps:
            if mine:
                self.decode(mine[i % len(mine)], token)
        for k, req in enumerate(reversed(mine)):
            self.finish(req, priority + k, abort=False, dtype=dtype)

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 15), priority=st.integers(-3, 3), evict_first=st.integers(0, 40))
    def serve_again(self, i: int, priority: int, evict_first: int) -> None:
        """Repeat a finished request: its walk re-stamps hits, priority and access of cached
        nodes, which only shows in the eviction order afterwards."""
        tokens, ns = self.history[i % len(self.history)]
        self.free(self.tree.call("evict", evict_first))
        self.start(tokens, ns, None)
        if self.requests and self.requests[-1].tokens == tokens:
            self.finish(self.requests[-1], priority, abort=False, dtype=None)

    @precondition(lambda self: len(self.requests) < 4)
    @rule(tokens=TOKENS, ns=NAMESPACES, dtype=DTYPES)
    def start_request(self, tokens: list[int], ns: str | None, dtype: Any) -> None:
        self.start(tokens, ns, dtype)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 5), token=st.integers(0, 3))
    def decode_one(self, i: int, token: int) -> None:
        self.decode(self.requests[i % len(self.requests)], token)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 5), priority=st.integers(-2, 2), abort=st.booleans(), dtype=DTYPES)
    def finish_request(self, i: int, priority: int, abort: bool, dtype: Any) -> None:
        self.finish(self.requests[i % len(self.requests)], priority, abort, dtype)

    # ------------------------------------------------------------ the tree alone
    @rule(tokens=TOKENS, ns=NAMESPACES, dtype=DTYPES)
    def match_only(self, tokens: list[int], ns: str | None, dtype: Any) -> None:
        _, node = self.tree.call("match_prefix", as_input(tokens, dtype), extra_key=ns)
        self.seen(node)

    @rule(num_tokens=st.integers(0, 120), group=st.booleans())
    def evict(self, num_tokens: int, group: bool) -> None:
        freed = self.tree.call("evict", num_tokens)
        assert len(freed) >= num_tokens or self.tree.call("evictable_size") == 0
        self.free(freed, group)

    @rule(data=st.data())
    def lock_some_node(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.seen_ids))
        if not isinstance(self.tree.call("lock", node), Failed):  # stale ids fail on both
            self.extra_locks.append(node)

    @precondition(lambda self: self.extra_locks)
    @rule(i=st.integers(0, 10))
    def unlock_some_node(self, i: int) -> None:
        assert not isinstance(
            self.tree.call("unlock", self.extra_locks.pop(i % len(self.extra_locks))), Failed
        )

    @precondition(lambda self: not self.requests and not self.extra_locks)
    @rule(data=st.data())
    def unlock_when_nothing_is_locked(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.seen_ids))
        assert isinstance(self.tree.call("unlock", node), Failed)  # RuntimeError, or stale

    @rule(data=st.data(), with_stale=st.booleans())
    def dfs_weight_order(self, data: st.DataObject, with_stale: bool) -> None:
        live = [int(i) for i in re.findall(r"\[(\d+)\]", self.tree.py.pretty_print())]
        ids = data.draw(
            st.lists(st.sampled_from(self.seen_ids if with_stale else live), max_size=12)
        )
        self.tree.call("dfs_weight_order", np.array(ids, dtype=np.int64) if with_stale else ids)

    @precondition(lambda self: not self.requests and not self.extra_locks)
    @rule(dice=st.integers(0, 7))
    def flush(self, dice: int) -> None:
        if dice:  # rare: a flush throws the whole cache away
            return
        self.free(self.tree.call("evict", self.tree.call("total_size")))
        self.tree.call("reset")  # ids seen so far are stale from now on

    # ------------------------------------------------------------ the allocator alone
    @rule(num_pages=st.integers(0, 6), off_page=st.booleans())
    def alloc_loose(self, num_pages: int, off_page: bool) -> None:
        n = num_pages * self.ps + (1 if off_page and self.ps > 1 else 0)
        slots = self.alloc.call("alloc", n)
        if isinstance(slots, np.ndarray):
            self.loose.append(slots)

    @precondition(lambda self: self.loose)
    @rule(i=st.integers(0, 10), dtype=DTYPES)
    def free_loose_twice(self, i: int, dtype: Any) -> None:
        slots = self.loose.pop(i % len(self.loose))
        self.free(as_input(slots, dtype))
        if len(slots):
            assert self.alloc.call("free", slots) == Failed(ValueError)

    @rule(prefix_pages=st.integers(0, 48), offset=st.integers(0, 15), extra=st.integers(0, 40))
    def alloc_extend_long(self, prefix_pages: int, offset: int, extra: int) -> None:
        """A request near or past the pool's size, often with a prefix so long that few new
        pages are needed: past capacity() both backends must answer None, and nothing changes."""
        ps = self.ps
        prefix_len = min(prefix_pages * ps, self.capacity + ps)
        last_loc, held = -1, None
        if offset % ps and prefix_len >= ps:
            # an unaligned prefix continues a page it holds: take one, end the prefix inside it
            held = self.alloc.call("alloc", ps)
            if held is not None:
                prefix_len -= ps - offset % ps
                last_loc = int(held[offset % ps - 1])
        seq_len = max(prefix_len, self.capacity - 2 * ps) + extra
        before = self.alloc.call("available_size")
        slots = self.alloc.call("alloc_extend", [prefix_len], [seq_len], [last_loc])
        assert not isinstance(slots, Failed)
        if seq_len > self.capacity:
            assert slots is None and self.alloc.call("available_size") == before
        if isinstance(slots, np.ndarray):  # free the new pages; the continued one is `held`
            continued = min(seq_len, -(-prefix_len // ps) * ps) - prefix_len
            self.free(slots[continued:])
        if held is not None:
            self.free(held)

    # ------------------------------------------------------------ bad input changes nothing
    @rule(call=st.sampled_from(BAD_TREE_CALLS + BAD_ALLOCATOR_CALLS))
    def bad_call(self, call: tuple) -> None:
        method, args, kwargs = call
        target = self.tree if hasattr(self.tree.py, method) else self.alloc
        before = (self.tree.py.pretty_print(), self.alloc.py.available_size())
        outcome = target.call(method, *args, **kwargs)
        assert outcome == Failed(RuntimeError if method == "free_group_end" else ValueError)
        assert (self.tree.py.pretty_print(), self.alloc.py.available_size()) == before

    # ------------------------------------------------------------ after every step
    @invariant()
    def backends_agree_and_hold_their_invariants(self) -> None:
        for method in (
            "evictable_size",
            "protected_size",
            "total_size",
            "node_count",
            "pretty_print",
        ):
            self.tree.call(method)
        self.tree.py.sanity_check()
        self.tree.rs.sanity_check()
        held = sum(
            len(np.unique(r.slots[r.own_from :] // self.ps)) * self.ps for r in self.requests
        )
        held += sum(len(s) for s in self.loose)
        for tree, alloc in ((self.tree.py, self.alloc.py), (self.tree.rs, self.alloc.rs)):
            total = alloc.available_size() + tree.evictable_size() + tree.protected_size() + held
            assert total == self.capacity, f"free + evictable + protected + held = {total}"


# ---------------------------------------------------------------------------- budget
SIZES = st.integers(-2, 6000)


class BudgetParity(RuleBasedStateMachine):
    """PrefillBudget arithmetic over both backends, including bad arguments."""

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        rem_input=st.integers(0, 8000),
        rem_chunk=st.one_of(st.none(), st.integers(0, 3000)),
        mixed=st.integers(0, 64),
    )
    def setup(self, page_size: int, rem_input: int, rem_chunk: int | None, mixed: int) -> None:
        self.ps = page_size
        self.budget = both("PrefillBudget", page_size, rem_input, rem_chunk, mixed)

    @rule(
        remaining=st.lists(st.integers(-10, 6000), max_size=6),
        data=st.data(),
        ratio=st.one_of(st.floats(0, 1), st.sampled_from([-0.1, 1.5, float("nan")])),
    )
    def reserve_running(self, remaining: list[int], data: st.DataObject, ratio: float) -> None:
        flags = data.draw(
            st.lists(st.booleans(), min_size=len(remaining), max_size=len(remaining) + 1)
        )
        self.budget.call("reserve_running", remaining, flags, ratio)

    @rule(available=SIZES)
    def state(self, available: int) -> None:
        self.budget.call("state", available)

    @rule(
        available=st.integers(-1, 20000), prefix=st.integers(-1, 3000), extend=SIZES, max_new=SIZES
    )
    def add_req(self, available: int, prefix: int, extend: int, max_new: int) -> None:
        room = available - self.budget.py.total_offset
        outcome = self.budget.call("add_req", available, prefix, extend, max_new)
        if isinstance(outcome, Failed):
            return
        # the one admission rule: NO_TOKEN iff the clipped max_new is over the limit
        limit = PY.PrefillBudget.max_new_tokens_limit(room, self.ps, extend) if room >= 0 else -1
        over = min(max_new, PY.CLIP_MAX_NEW_TOKENS) > limit
        assert (outcome[1] == PY.AddReqResult.NO_TOKEN and not outcome[0]) == over, outcome

    @rule(available=st.integers(-1, 20000), extend=SIZES, max_new=SIZES)
    def shortfall(self, available: int, extend: int, max_new: int) -> None:
        short = self.budget.call("shortfall", available, extend, max_new)
        if isinstance(short, Failed) or short == 0:
            return
        # add_req's edge: `short` more tokens admit it, one fewer do not
        for extra, admitted in ((short, True), (short - 1, False)):
            trial = PY.PrefillBudget(self.ps, 10**12, None, self.budget.py.total_offset)
            assert trial.add_req(available + extra, 0, extend, max_new)[0] == admitted

    @rule(extend=SIZES, max_new=st.integers(-2, 12000))
    def whole_life_need(self, extend: int, max_new: int) -> None:
        self.budget.call("whole_life_need", extend, max_new)

    @rule(
        available=st.integers(-1, 40000),
        prefix=st.integers(-1, 3000),
        extend=SIZES,
        max_new=st.integers(-2, 12000),
    )
    def add_req_whole_life(self, available: int, prefix: int, extend: int, max_new: int) -> None:
        py = self.budget.py
        need = py.whole_life_need(extend, max_new) if extend >= 1 and max_new >= 0 else None
        outcome = self.budget.call("add_req_whole_life", available, prefix, extend, max_new)
        if isinstance(outcome, Failed):
            return
        # a refusal for memory iff its life does not fit; otherwise admitted whole (never cut)
        # or refused by the input or chunk budget
        if need > available:
            assert outcome == (False, PY.AddReqResult.NO_TOKEN, 0)
        else:
            assert outcome[:1] + outcome[2:] == (True, extend) or outcome[::2] == (False, 0)
            assert outcome[0] or outcome[1] == PY.AddReqResult.OTHER

    @rule(
        available=st.integers(-1, 20000),
        prefix=st.integers(-1, 3000),
        remaining=SIZES,
        max_new=SIZES,
    )
    def add_chunk(self, available: int, prefix: int, remaining: int, max_new: int) -> None:
        self.budget.call("add_chunk", available, prefix, remaining, max_new)

    @invariant()
    def views_agree(self) -> None:
        for name in (
            "total_offset",
            "current_offset",
            "rem_input_tokens",
            "rem_chunk_tokens",
            "num_admitted",
        ):
            assert_same(getattr(self.budget.py, name), getattr(self.budget.rs, name), name)


LIMIT_ARGS = st.one_of(
    st.integers(-3, 20_000),
    st.sampled_from([True, 1.0, "4", None, np.int32(7), np.uint64(9), -(2**40)]),
)


@needs_rust
@PARITY
@given(capacity=LIMIT_ARGS, page_size=LIMIT_ARGS, prompt_len=LIMIT_ARGS)
def test_max_new_tokens_limit_parity(capacity: Any, page_size: Any, prompt_len: Any) -> None:
    """Same limit or same exception; and on both backends the limit is add_req's edge."""
    pair = Pair(PY.PrefillBudget, RS.PrefillBudget)
    limit = pair.call("max_new_tokens_limit", capacity, page_size, prompt_len)
    if isinstance(limit, Failed) or prompt_len < 1 or limit + 1 >= PY.CLIP_MAX_NEW_TOKENS:
        return
    for backend in (PY, RS):
        if limit >= 0:
            admit = backend.PrefillBudget(page_size, 10**6).add_req(capacity, 0, prompt_len, limit)
            assert admit[0] and admit[2] == prompt_len, (backend.name, admit)
        refuse = backend.PrefillBudget(page_size, 10**6)
        verdict = refuse.add_req(capacity, 0, prompt_len, max(limit + 1, 0))
        assert verdict == (False, backend.AddReqResult.NO_TOKEN, 0), (backend.name, verdict)


# ---------------------------------------------------------------------------- the tests
@needs_rust
def test_tree_and_allocator_parity():
    run_state_machine_as_test(
        TreeCoreParity, settings=settings(PARITY, max_examples=250, stateful_step_count=40)
    )


@needs_rust
def test_budget_parity():
    run_state_machine_as_test(
        BudgetParity, settings=settings(PARITY, max_examples=200, stateful_step_count=20)
    )


@needs_rust
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_long_trace_parity(page_size: int, policy: str):
    """A longer seeded serving trace than hypothesis runs: same results, call by call."""
    rng = np.random.default_rng(page_size * 31 + POLICIES.index(policy))
    tree = both("RadixTree", page_size, policy)
    alloc = both("PageAllocator", 4096, page_size)
    prompts = [rng.integers(0, 50, int(rng.integers(20, 200))) for _ in range(6)]
    history: list[tuple[np.ndarray, str | None]] = []
    for step in range(400):
        if history and step % 3 == 0:  # a repeat walks (and re-stamps) cached leaves
            tokens, ns = history[int(rng.integers(len(history)))]
        else:
            suffix = rng.integers(0, 50, int(rng.integers(1, 60)))
            tokens = np.concatenate([prompts[step % 6], suffix])
            ns = "tenant" if step % 5 == 0 else None
            history = [(tokens, ns), *history[:30]]
        prefix, node = tree.call("match_prefix", tokens, extra_key=ns)
        tree.call("lock", node)
        own = alloc.call("alloc_extend", [len(prefix)], [len(tokens)], [-1])
        if own is None:
            alloc.call("free", tree.call("evict", len(tokens) + page_size))
            own = alloc.call("alloc_extend", [len(prefix)], [len(tokens)], [-1])
        assert isinstance(own, np.ndarray)
        slots = np.concatenate([prefix, own])
        priority = int(rng.integers(-3, 4))
        cached, _ = tree.call("insert", tokens, slots, extra_key=ns, priority=priority)
        key_len = len(tokens) // page_size * page_size
        alloc.call("free", np.concatenate([slots[len(prefix) : cached], slots[key_len:]]))
        tree.call("unlock", node)
        if step % 50 == 49:
            tree.py.sanity_check()
            tree.rs.sanity_check()
            tree.call("pretty_print")
    assert tree.call("total_size") + alloc.call("available_size") == alloc.call("capacity")


@needs_rust
@pytest.mark.parametrize("page_size", [1, 16])
def test_long_keys_parity(page_size: int):
    """Keys long enough for the native core to release the GIL (it then works on a copy)."""
    rng = np.random.default_rng(page_size)
    tree = both("RadixTree", page_size, "lru")
    base = rng.integers(0, 100, 12_000)
    next_slot = 1
    for step in range(12):
        cut = int(rng.integers(4_000, 12_000))
        tokens = np.concatenate([base[:cut], rng.integers(0, 100, int(rng.integers(0, 3_000)))])
        slots = np.arange(next_slot, next_slot + len(tokens))
        next_slot += len(tokens)
        tokens_in = tokens.tolist() if step % 3 == 0 else tokens.astype(np.int32)
        tree.call("match_prefix", tokens_in, extra_key="long" if step % 4 == 0 else None)
        tree.call("insert", tokens_in, slots, extra_key="long" if step % 4 == 0 else None)
        if step % 5 == 4:
            tree.call("evict", 5_000)
        tree.py.sanity_check()
        tree.rs.sanity_check()
    tree.call("pretty_print")
    tree.call("evict", 10**9)
