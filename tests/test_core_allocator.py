"""PageAllocator contract, run on both tree-core backends."""

from __future__ import annotations

import numpy as np
import pytest


def test_alloc_free_page1(core):
    a = core.PageAllocator(8)
    assert a.available_size() == 8
    x = a.alloc(3)
    assert x.dtype == np.int64 and x.tolist() == [1, 2, 3]  # slot 0 is reserved
    assert a.available_size() == 5
    assert a.alloc(6) is None and a.available_size() == 5  # not enough: nothing changes
    a.free(x[::-1].copy())
    assert a.available_size() == 8
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]  # FIFO: freed slots are reused last
    assert a.alloc(3).tolist() == [1, 2, 3]


def test_alloc_pages(core):
    a = core.PageAllocator(64, page_size=16)  # pages 1..4
    x = a.alloc(32)
    assert x.tolist() == list(range(16, 48))
    with pytest.raises(ValueError):
        a.alloc(5)  # not page aligned
    a.free(x[:1])  # one slot frees its whole page
    assert a.available_size() == 48
    with pytest.raises(ValueError):
        a.free([17])  # page 1 is free already
    a.free(x[16:])
    assert a.available_size() == 64


def test_foreign_and_double_free(core):
    a = core.PageAllocator(8)
    x = a.alloc(2)
    for bad in ([0], [9], [-1], [100]):
        with pytest.raises(ValueError):
            a.free(bad)
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)
    assert a.available_size() == 8
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_free_group_stages_until_end(core):
    a = core.PageAllocator(8)
    x = a.alloc(4)
    a.free_group_begin()
    a.free(x[:2])
    a.free(x[2:])
    assert a.available_size() == 4
    with pytest.raises(ValueError):
        a.free(x[:1])  # already staged
    with pytest.raises(RuntimeError):
        a.free_group_begin()
    a.free_group_end()
    assert a.available_size() == 8
    with pytest.raises(RuntimeError):
        a.free_group_end()


def test_alloc_extend_continues_partial_pages(core):
    ps = 4
    a = core.PageAllocator(64, page_size=ps)  # pages 1..16
    first = a.alloc_extend([0], [6], [-1])
    assert first.tolist() == [4, 5, 6, 7, 8, 9]  # page 1 and half of page 2
    # request continues from prefix 6 (last slot 9) to 11 tokens: fills 10, 11 then a new page
    more = a.alloc_extend([6], [11], [9])
    assert more.tolist() == [10, 11, 12, 13, 14]
    # two requests in one call: pages are taken in request order
    both = a.alloc_extend([0, 11], [3, 13], [-1, 14])
    assert both.tolist() == [16, 17, 18, 15, 20]
    assert a.available_size() == (16 - 5) * ps


def test_alloc_extend_validation_and_oom(core):
    a = core.PageAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        a.alloc_extend([0, 0], [1], [-1, -1])  # lengths differ
    with pytest.raises(ValueError):
        a.alloc_extend([5], [3], [-1])  # prefix > seq
    with pytest.raises(ValueError):
        a.alloc_extend([3], [5], [-1])  # partial page without a last slot
    with pytest.raises(ValueError):
        a.alloc_extend([3], [5], [4])  # misaligned last slot
    assert a.alloc_extend([0], [17], [-1]) is None
    assert a.available_size() == 16
    assert len(a.alloc_extend([0], [16], [-1])) == 16
    assert a.alloc_extend([0], [1], [-1]) is None


def test_alloc_decode(core):
    a = core.PageAllocator(32, page_size=4)
    prompt = a.alloc_extend([0, 0], [4, 3], [-1, -1])
    assert prompt.tolist() == [4, 5, 6, 7, 8, 9, 10]
    # request 0 has 4 tokens (page full): needs a new page; request 1 continues at 11
    step = a.alloc_decode([5, 4], [7, 10])
    assert step.tolist() == [12, 11]
    with pytest.raises(ValueError):
        a.alloc_decode([0], [-1])


def test_matches_naive_reference(core):
    rng = np.random.default_rng(1)
    ps = 16
    a = core.PageAllocator(4096, page_size=ps)
    owned: dict[int, list[int]] = {}
    for step in range(200):
        rid = int(rng.integers(0, 12))
        seq = owned.setdefault(rid, [])
        grow = int(rng.integers(1, 40))
        last = seq[-1] if seq else -1
        new = a.alloc_extend([len(seq)], [len(seq) + grow], [last])
        if new is None:
            continue
        new = new.tolist()
        # page-continuing: position j of a sequence lives at offset j % ps of its page
        for j, slot in enumerate(new, start=len(seq)):
            assert slot % ps == j % ps
        seq.extend(new)
        if step % 7 == 0:
            victim = owned.pop(int(rng.integers(0, 12)), [])
            a.free(victim)
    held_pages = {s // ps for seq in owned.values() for s in seq}
    assert len(held_pages) * ps + a.available_size() == 4096
    all_slots = [s for seq in owned.values() for s in seq]
    assert len(all_slots) == len(set(all_slots))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_extend_longer_than_the_pool_is_none(core, page_size):
    """Every position of a request has its own slot: seq_len > capacity can never be held,
    however few new pages it needs, so the answer is None and nothing changes."""
    ps = page_size
    a = core.PageAllocator(8 * ps + ps - 1, page_size=ps)  # the odd tail makes no page
    cap = a.capacity()
    assert cap == 8 * ps
    held = a.alloc(2 * ps)  # two pages held by some request
    free_before = a.available_size()
    # a prefix as long as the pool: one new page would do, but the request cannot fit
    assert a.alloc_extend([cap], [cap + 1], [-1]) is None
    # an unaligned prefix whose partial page is held (a valid last_loc): few new pages
    if ps > 1:
        p = cap - 1
        last = int(held[(p - 1) % ps])
        assert (last + 1) % ps == p % ps
        assert a.alloc_extend([p], [cap + 1], [last]) is None
    # one request of a batch over the pool: the whole call is refused
    assert a.alloc_extend([0, 0], [1, cap + 1], [-1, -1]) is None
    assert a.alloc_decode([cap + 1], [int(held[-1])]) is None
    assert a.available_size() == free_before
    # argument errors come first
    with pytest.raises(ValueError):
        a.alloc_extend([cap + 2], [cap + 1], [-1])
    with pytest.raises(ValueError):
        a.alloc_extend([0, 0], [cap + 1], [-1, -1])
    # exactly the capacity is not refused for its length (only for want of pages)
    assert a.alloc_extend([0], [cap], [-1]) is None
    a.free(held)
    assert len(a.alloc_extend([0], [cap], [-1])) == cap


def test_alloc_extend_on_an_empty_pool(core):
    a = core.PageAllocator(3, page_size=4)  # no whole page: capacity 0
    assert a.capacity() == 0
    assert a.alloc_extend([0], [0], [-1]).tolist() == []
    assert a.alloc_extend([0], [1], [-1]) is None
