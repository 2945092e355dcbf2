"""PrefillBudget (admission arithmetic) contract, run on both tree-core backends."""

from __future__ import annotations

import numpy as np
import pytest


def test_constants(core):
    r = core.AddReqResult
    assert (r.CONTINUE, r.NO_TOKEN, r.OTHER) == (0, 1, 2)
    assert core.CLIP_MAX_NEW_TOKENS == 4096


def test_charge_is_paged_extend_plus_page_plus_max_new(core):
    b = core.PrefillBudget(16, rem_input_tokens=8192)
    ok, state, granted = b.add_req(
        available=10_000, prefix_len=0, extend_len=20, max_new_tokens=100
    )
    assert ok and granted == 20 and state == core.AddReqResult.CONTINUE
    assert b.total_offset == 32 + 16 + 100
    assert b.current_offset == 32 + 16
    assert b.rem_input_tokens == 8192 - 32
    assert b.num_admitted == 1


def test_max_new_is_clipped_for_the_estimate(core):
    b = core.PrefillBudget(1, rem_input_tokens=100_000)
    b.add_req(100_000, 0, 10, 50_000)
    assert b.total_offset == 10 + 1 + 4096


def test_no_token_when_memory_short(core):
    b = core.PrefillBudget(1, rem_input_tokens=8192)
    # needs 100 + 10 + 1 = 111 < available strictly
    assert b.add_req(111, 0, 100, 10) == (False, core.AddReqResult.NO_TOKEN, 0)
    assert b.total_offset == 0 and b.num_admitted == 0
    ok, _, _ = b.add_req(112, 0, 100, 10)
    assert ok


def test_running_reservation(core):
    b = core.PrefillBudget(1, rem_input_tokens=8192)
    reserved = b.reserve_running([100, 5000, 10, -3], [False, False, True, False], 0.5)
    assert reserved == 50 + 2048 + 10 + 0
    assert b.total_offset == reserved
    assert b.state(reserved) == core.AddReqResult.NO_TOKEN
    assert b.state(reserved + 1) == core.AddReqResult.CONTINUE
    with pytest.raises(ValueError):
        b.reserve_running([1, 2], [False], 0.5)
    with pytest.raises(ValueError):
        b.reserve_running([1], [False], 1.5)


def test_input_budget_first_request_may_exceed(core):
    b = core.PrefillBudget(1, rem_input_tokens=100)
    ok, state, granted = b.add_req(10_000, 0, 150, 1)
    assert ok and granted == 150 and state == core.AddReqResult.OTHER
    b2 = core.PrefillBudget(1, rem_input_tokens=100)
    assert b2.add_req(10_000, 0, 60, 1)[0]
    assert b2.add_req(10_000, 0, 40, 1) == (False, core.AddReqResult.OTHER, 0)  # reaches the cap
    assert b2.add_req(10_000, 0, 39, 1)[0]


def test_chunking_page_aligned_end(core):
    ps = 16
    b = core.PrefillBudget(ps, rem_input_tokens=10_000, rem_chunk_tokens=100)
    # prompt of 300 with a 32-token cached prefix: chunk to a page-aligned end
    ok, state, granted = b.add_req(100_000, 32, 268, 50)
    assert ok and granted == 96 and (32 + granted) % ps == 0
    assert b.total_offset == 96 + ps  # a cut request reserves no decode tokens
    assert b.rem_chunk_tokens == 100 - 96
    assert state == core.AddReqResult.CONTINUE
    # the chunk budget is nearly spent: the next request cannot get a page
    assert b.add_req(100_000, 0, 40, 1) == (False, core.AddReqResult.OTHER, 0)


def test_add_chunk_progresses_and_reserves_on_last(core):
    ps = 4
    b = core.PrefillBudget(ps, rem_input_tokens=10_000, rem_chunk_tokens=64)
    state, granted = b.add_chunk(100_000, 64, 200, 30)
    assert granted == 64 and b.total_offset == 64 + ps
    b2 = core.PrefillBudget(ps, rem_input_tokens=10_000, rem_chunk_tokens=64)
    state, granted = b2.add_chunk(100_000, 128, 10, 30)
    assert granted == 10 and b2.total_offset == 12 + ps + 30  # last slice reserves decode
    # memory nearly exhausted still progresses by the chunk budget
    b3 = core.PrefillBudget(ps, rem_input_tokens=10_000, rem_chunk_tokens=64)
    b3.reserve_running([1000], [True], 0.7)
    state, granted = b3.add_chunk(1000, 0, 500, 30)
    assert granted == 64 and state == core.AddReqResult.NO_TOKEN
    with pytest.raises(ValueError):
        core.PrefillBudget(ps, 100).add_chunk(100, 0, 10, 1)  # chunking is off


def test_mixed_decode_tokens_charged_up_front(core):
    b = core.PrefillBudget(1, rem_input_tokens=100, rem_chunk_tokens=50, num_mixed_decode_tokens=8)
    assert b.rem_input_tokens == 92 and b.rem_chunk_tokens == 42
    assert b.total_offset == 8 and b.current_offset == 8


def test_bad_arguments(core):
    with pytest.raises(ValueError):
        core.PrefillBudget(0, 100)
    with pytest.raises(ValueError):
        core.PrefillBudget(1, -5)
    b = core.PrefillBudget(1, 100)
    with pytest.raises(ValueError):
        b.add_req(100, 0, 0, 1)
    with pytest.raises(ValueError):
        b.add_req(-1, 0, 1, 1)
    with pytest.raises(ValueError):
        b.add_req(100, 0, 1, -1)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("capacity", [0, 1, 17, 64, 1000, 4096 + 40])
@pytest.mark.parametrize("prompt_len", [1, 3, 16, 33, 500])
def test_max_new_tokens_limit_is_add_reqs_rule(core, page_size, capacity, prompt_len):
    """The limit is the largest max_new_tokens that add_req admits into an idle pool."""
    limit = core.PrefillBudget.max_new_tokens_limit(capacity, page_size, prompt_len)
    assert limit == capacity - page_size - prompt_len - 1
    if limit >= 0:
        admitted = core.PrefillBudget(page_size, rem_input_tokens=10_000)
        ok, _, granted = admitted.add_req(capacity, 0, prompt_len, limit)
        assert ok and granted == prompt_len
    if limit + 1 < core.CLIP_MAX_NEW_TOKENS:
        refused = core.PrefillBudget(page_size, rem_input_tokens=10_000)
        no_token = (False, core.AddReqResult.NO_TOKEN, 0)
        assert refused.add_req(capacity, 0, prompt_len, max(limit + 1, 0)) == no_token


def test_max_new_tokens_limit_above_the_clip_admits_anything(core):
    limit = core.PrefillBudget.max_new_tokens_limit(10_000, 4, 100)
    assert limit == 10_000 - 4 - 100 - 1 > core.CLIP_MAX_NEW_TOKENS
    b = core.PrefillBudget(4, rem_input_tokens=10_000)
    assert b.add_req(10_000, 0, 100, 10**9)[0]  # the estimate clips max_new at 4096


def test_max_new_tokens_limit_is_static_and_validated(core):
    limit = core.PrefillBudget.max_new_tokens_limit
    assert core.PrefillBudget(4, 100).max_new_tokens_limit(64, 4, 10) == limit(64, 4, 10) == 49
    assert limit(capacity=0, page_size=1, prompt_len=0) == -2  # < 1: cannot fit
    assert limit(np.int64(64), np.int32(4), np.uint8(10)) == 49
    for bad in (
        (-1, 1, 1),
        (10, 0, 1),
        (10, -4, 1),
        (10, 1, -1),
        (10.0, 1, 1),
        (10, 1.5, 1),
        (10, 1, "3"),
        (True, 1, 1),
        (10, True, 1),
        (10, 1, None),
    ):
        with pytest.raises(ValueError):
            limit(*bad)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shortfall_is_how_far_add_req_is_from_admitting(core, page_size):
    b = core.PrefillBudget(page_size, rem_input_tokens=100_000)
    b.reserve_running([1000, 9000], [True, True], 0.7)  # 1000 + 4096 (clipped), exact
    assert b.shortfall(20_000, 100, 50) == 0  # fits
    short = b.shortfall(5_000, 100, 50)
    assert short == 1000 + 4096 + 100 + 50 + page_size + 1 - 5_000
    for extra, admitted in ((short, True), (short - 1, False)):
        trial = core.PrefillBudget(page_size, 100_000, None, b.total_offset)
        assert trial.add_req(5_000 + extra, 0, 100, 50)[0] == admitted
    assert b.shortfall(5_000, 100, 10**6) == b.shortfall(5_000, 100, 4096)  # clipped
    assert b.total_offset == 5096 and b.num_admitted == 0  # charges nothing
    with pytest.raises(ValueError):
        b.shortfall(100, 0, 1)
    with pytest.raises(ValueError):
        b.shortfall(-1, 1, 1)
