"""The host tier against a reference model, on each backend and on both side by side.

A hypothesis state machine drives a RadixTree with a host tier and a device PageAllocator
beside it, as the cache manager does (match, lock, allocate, insert, free duplicates; load
back host hits; back up; evict, with and without write-back; evict host), and keeps its own
model of the tiers: for every page-aligned token prefix, its device slots and host slots.
After every step it checks the model against the tree (`match_prefix_host` on the model's
longest prefixes reports exactly the modelled slots), the device conservation law (free +
evictable + protected == capacity), the host ledger (used == the modelled host tokens,
every host slot owned once), the device-parent invariant, and `sanity_check()`.

Host eviction inside `backup` / `evict_write_back` / `evict_host` is the one thing the
model does not predict (it does not model the policy order); there, prefixes may vanish,
but only host-only ones, and the ledgers must still agree. The differential variant runs
the same machine on the Python and the Rust core at once and compares every result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fixtures.backends import load_backend
from test_core_parity import PARITY, POLICIES, PY, RS, Failed, Pair, needs_rust

BASES = [np.random.default_rng(seed + 7).integers(0, 3, 24).tolist() for seed in range(2)]
TOKENS = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 24).map(lambda n: 24 - n),
    st.lists(st.integers(0, 2), max_size=6),
)
NAMESPACES = st.sampled_from([None, "a"])
Key = tuple  # (namespace, token tuple of whole pages)


class Single:
    """One backend object with Pair's calling convention (exceptions become Failed)."""

    def __init__(self, obj: Any):
        self.py, self.objs = obj, (obj,)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.py, method)(*args, **kwargs)
        except (ValueError, RuntimeError) as e:
            return Failed(type(e))


class TiersModel(RuleBasedStateMachine):
    backends: tuple = (PY,)

    def make(self, cls: str, *args: Any) -> Any:
        objs = [getattr(b, cls)(*args) for b in self.backends]
        if len(objs) == 1:
            return Single(objs[0])
        pair = Pair(*objs)
        pair.objs = tuple(objs)
        return pair

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(POLICIES),
        device_slots=st.integers(24, 80),
        host_slots=st.sampled_from([0, 12, 48, 128]),
        write_back=st.booleans(),
    )
    def setup(
        self, page_size: int, policy: str, device_slots: int, host_slots: int, write_back: bool
    ) -> None:
        self.ps = page_size
        self.tree = self.make("RadixTree", page_size, policy, host_slots)
        self.alloc = self.make("PageAllocator", device_slots, page_size)
        self.capacity = self.alloc.call("capacity")
        self.model: dict[Key, list] = {}  # key -> [device slots | None, host slots | None]
        self.owner: dict[int, Key] = {}  # first device slot of a page -> its key
        self.seen = [0]
        self.locks: list[int] = []
        self.history: list[tuple[list[int], str | None]] = []
        self.write_back = write_back  # how allocation under pressure evicts

    # ------------------------------------------------------------ model helpers
    def keys_of(self, tokens: list[int], ns: str | None) -> list[Key]:
        return [(ns, tuple(tokens[: k * self.ps])) for k in range(1, len(tokens) // self.ps + 1)]

    def set_device(self, key: Key, slots: np.ndarray) -> None:
        self.model[key][0] = tuple(slots.tolist())
        self.owner[int(slots[0])] = key

    def below(self, key: Key) -> list[Key]:
        ns, toks = key
        return [
            k
            for k in self.model
            if k[0] == ns and len(k[1]) > len(toks) and k[1][: len(toks)] == toks
        ]

    def expected(self, path: list[Key]) -> tuple[list[int], list[int]]:
        device: list[int] = []
        host: list[int] = []
        for key in path:
            dev, hst = self.model[key]
            if dev is not None and not host:
                device.extend(dev)
            else:
                host.extend(hst)
        return device, host

    def apply_copies(self, src: np.ndarray, dst: np.ndarray) -> None:
        """backup / write-back: each source page's node got the destination page."""
        assert len(src) == len(dst)
        for i in range(0, len(src), self.ps):
            key = self.owner[int(src[i])]
            assert self.model[key][0] == tuple(src[i : i + self.ps].tolist())
            assert self.model[key][1] is None, f"{key} was backed up twice"
            self.model[key][1] = tuple(dst[i : i + self.ps].tolist())

    def apply_freed(self, freed: np.ndarray) -> None:
        """Device eviction: backed-up pages turn host-only, the others go with what is below."""
        doomed = []
        for i in range(0, len(freed), self.ps):
            key = self.owner.pop(int(freed[i]))
            assert self.model[key][0] == tuple(freed[i : i + self.ps].tolist())
            self.model[key][0] = None
            if self.model[key][1] is None:
                doomed.append(key)
        for key in doomed:
            for k in [key, *self.below(key)]:
                if k in self.model:
                    assert self.model[k][0] is None, f"{k} was on the device below an evicted page"
                    del self.model[k]
        self.alloc.call("free", freed)

    def evict_device(self, num_tokens: int, write_back: bool = False) -> None:
        before = self.tree.call("host_used_size")
        if write_back:
            freed, src, dst = self.tree.call("evict_write_back", num_tokens)
            self.apply_copies(src, dst)
        else:
            freed, src = self.tree.call("evict", num_tokens), []
        assert len(freed) >= num_tokens or self.tree.call("evictable_size") == 0
        self.apply_freed(freed)
        self.probe(may_drop=self.tree.call("host_used_size") != before + len(src))

    def alloc_or_evict(self, method: str, *args: Any) -> np.ndarray | None:
        slots = self.alloc.call(method, *args)
        if slots is None:
            self.evict_device(16 + 2 * self.ps, self.write_back)
            slots = self.alloc.call(method, *args)
        assert not isinstance(slots, Failed)
        return slots

    def probe(self, may_drop: bool = False) -> None:
        """match_prefix_host on every longest modelled prefix must report the modelled slots.

        A longest prefix ends at a tree leaf, so the probes split nothing. Prefixes the tree
        no longer holds were host evicted: allowed only when may_drop, and only host-only."""
        parents = {(ns, toks[: -self.ps]) for ns, toks in self.model}
        for key in [k for k in self.model if k not in parents]:
            if key not in self.model:
                continue
            ns, toks = key
            dev, _, host, host_node = self.tree.call("match_prefix_host", list(toks), ns)
            path = self.keys_of(list(toks), ns)
            reached = (len(dev) + len(host)) // self.ps
            for gone in [k for k in path[reached:] if k in self.model]:
                assert may_drop, f"{gone} vanished"
                assert self.model[gone][0] is None, f"device-resident {gone} was host evicted"
                del self.model[gone]
            assert (dev.tolist(), host.tolist()) == self.expected(path[:reached])
            if host_node not in self.seen:
                self.seen.append(host_node)

    # ------------------------------------------------------------ rules
    def match(self, tokens: list[int], ns: str | None, load: bool) -> tuple[np.ndarray, int]:
        """The cache manager's match: the device prefix, plus the host hit loaded back (all
        or nothing) when `load`. Returns (prefix slots, last node)."""
        dev, dev_node, host, host_node = self.tree.call("match_prefix_host", tokens, ns)
        path = [k for k in self.keys_of(tokens, ns) if k in self.model]
        got = (dev.tolist(), host.tolist())
        assert got == self.expected(path[: (len(dev) + len(host)) // self.ps])
        if not len(host) or not load:
            assert len(host) or host_node == dev_node
            return dev, dev_node
        self.tree.call("lock", host_node)  # holds the device prefix and the host chain
        slots = self.alloc_or_evict("alloc", len(host))
        if slots is not None:
            assert self.tree.call("load_back", host_node, slots) is None
            first = len(dev) // self.ps
            for k, key in enumerate(path[first : first + len(host) // self.ps]):
                self.set_device(key, slots[k * self.ps : (k + 1) * self.ps])
        self.tree.call("unlock", host_node)
        return (dev, dev_node) if slots is None else (np.concatenate([dev, slots]), host_node)

    @rule(
        tokens=TOKENS,
        ns=NAMESPACES,
        priority=st.integers(-1, 1),
        write=st.integers(0, 2),
        load=st.booleans(),
    )
    def insert(self, tokens: list[int], ns: str | None, priority: int, write: int, load: bool):
        """A request's life; then write=1: write_through, 2: write_through_selective."""
        prefix, node = self.match(tokens, ns, load)
        path = self.keys_of(tokens, ns)
        self.tree.call("lock", node)
        own = self.alloc_or_evict("alloc_extend", [len(prefix)], [len(tokens)], [-1])
        if own is None:
            self.tree.call("unlock", node)
            return
        slots = np.concatenate([prefix, own])
        cached, leaf = self.tree.call("insert", tokens, slots, ns, priority)
        on_device = 0
        while on_device < len(path) and self.model.get(path[on_device], [None])[0] is not None:
            on_device += 1
        assert cached == on_device * self.ps
        for k, key in enumerate(path[on_device:], on_device):
            self.model.setdefault(key, [None, None])
            self.set_device(key, slots[k * self.ps : (k + 1) * self.ps])
        key_len = len(path) * self.ps
        self.alloc.call("free", np.concatenate([slots[len(prefix) : cached], slots[key_len:]]))
        self.tree.call("unlock", node)
        self.seen.append(leaf)
        self.history = [(tokens, ns), *self.history[:11]]
        if write:
            self.backup_node(leaf, write)

    @precondition(lambda self: self.history)
    @rule(i=st.integers(0, 11))
    def load_back(self, i: int) -> None:
        tokens, ns = self.history[i % len(self.history)]
        self.match(tokens, ns, load=True)

    @rule(data=st.data(), min_hits=st.integers(1, 3))
    def backup(self, data: st.DataObject, min_hits: int) -> None:
        self.backup_node(data.draw(st.sampled_from(self.seen)), min_hits)

    def backup_node(self, node: int, min_hits: int) -> None:
        before = self.tree.call("host_used_size")
        out = self.tree.call("backup", node, min_hits)
        if isinstance(out, Failed):
            assert out == Failed(ValueError)  # a stale id
            return
        src, dst = out
        self.apply_copies(src, dst)
        self.probe(may_drop=self.tree.call("host_used_size") != before + len(dst))

    @rule(num_tokens=st.integers(0, 40), write_back=st.booleans())
    def evict(self, num_tokens: int, write_back: bool) -> None:
        self.evict_device(num_tokens, write_back)

    @rule()
    def write_back_one_then_evict_one(self) -> None:
        """The leaf goes host-only, then its unbacked parent is deleted along with it."""
        self.evict_device(1, write_back=True)
        self.evict_device(1)

    @rule(num_tokens=st.integers(0, 40))
    def evict_host(self, num_tokens: int) -> None:
        before = self.tree.call("host_used_size")
        freed = self.tree.call("evict_host", num_tokens)
        assert self.tree.call("host_used_size") == before - freed
        self.probe(may_drop=freed > 0)
        if freed < num_tokens and not self.locks:  # every host-only node went
            assert all(dev is not None for dev, _ in self.model.values())

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.seen))
        if self.tree.call("lock", node) is None:
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 9))
    def unlock(self, i: int) -> None:
        assert self.tree.call("unlock", self.locks.pop(i % len(self.locks))) is None

    @precondition(lambda self: not self.locks)
    @rule(dice=st.integers(0, 9))
    def flush(self, dice: int) -> None:
        if dice:
            return
        self.evict_device(self.tree.call("total_size"))
        self.tree.call("reset")
        self.model.clear()
        self.owner.clear()

    # ------------------------------------------------------------ after every step
    @invariant()
    def tiers_agree_with_the_model(self) -> None:
        self.probe()
        self.tree.call("node_count")
        self.tree.call("pretty_print")  # the same nodes, ids and residencies on both cores
        for obj in self.tree.objs:
            obj.sanity_check()
        device = sum(1 for dev, _ in self.model.values() if dev is not None) * self.ps
        host = [s for _, hst in self.model.values() if hst is not None for s in hst]
        assert self.tree.call("total_size") == device
        assert self.tree.call("host_used_size") == len(host) == len(set(host))
        assert self.tree.call("host_available_size") + len(host) == self.tree.call("host_capacity")
        free = self.alloc.call("available_size")
        assert (
            free + self.tree.call("evictable_size") + self.tree.call("protected_size")
            == self.capacity
        )
        for (ns, toks), (dev, _) in self.model.items():
            parent = (ns, toks[: -self.ps])
            assert dev is None or len(toks) == self.ps or self.model[parent][0] is not None


TIERS = settings(PARITY, max_examples=150, stateful_step_count=40)


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_tiers_against_the_model(backend: str) -> None:
    core = load_backend(backend)
    machine = type(f"TiersModel_{backend}", (TiersModel,), {"backends": (core,)})
    run_state_machine_as_test(machine, settings=TIERS)


@needs_rust
def test_tiers_parity() -> None:
    machine = type("TiersParity", (TiersModel,), {"backends": (PY, RS)})
    run_state_machine_as_test(machine, settings=TIERS)
