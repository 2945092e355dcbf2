"""The dynamic chunk sizer (scheduler/chunk_sizer.py): the fit, each rule of the prediction,
and that the scheduler's continuation chunks follow it."""

from __future__ import annotations

import pytest

from fixtures.sched import Harness
from sglite.scheduler.chunk_sizer import ChunkSizer, CostModel, build_sizer, sample_lengths

TRUE = CostModel(a=1e-4, b=0.5, c=3.0)


def f(n: int, m: CostModel = TRUE) -> float:
    return m.a * n * n + m.b * n + m.c


def test_fit_recovers_the_model_and_drops_the_warm_up():
    lengths = list(range(640, 0, -40))
    ms = [f(n) for n in lengths]
    ms[0] = 1e6  # the warm-up outlier
    fit = CostModel.fit(lengths, ms)
    assert fit is not None
    assert fit.a == pytest.approx(TRUE.a) and fit.b == pytest.approx(TRUE.b)
    assert fit.c == pytest.approx(TRUE.c)


def test_fit_rejections_and_clamp():
    lengths = list(range(640, 0, -40))
    assert CostModel.fit(lengths[:8], [f(n) for n in lengths[:8]]) is None  # 7 after the warm-up
    assert CostModel.fit(lengths, [5.0 - 1e-4 * n * n for n in lengths]) is None  # a <= 0
    clamped = CostModel.fit(lengths, [1e-3 * n * n - 0.1 * n + 1 for n in lengths])
    assert clamped is not None and clamped.b == 0.0


def sizer(**kw) -> ChunkSizer:
    args = {"base": 512, "page_size": 1, "context_len": 1 << 20, "max_prefill_tokens": 16384}
    return ChunkSizer(TRUE, **{**args, **kw})


def test_prediction_rules():
    exact = sizer(smooth=1.0)
    assert exact.predict(0) == 512
    sizes = [exact.predict(L) for L in range(0, 64_000, 4000)]
    assert all(x <= y for x, y in zip(sizes[1:], sizes)) and sizes[-1] < 512
    assert all(s % 64 == 0 for s in sizes)  # aligned to max(page, 64)
    assert sizer(page_size=128, smooth=1.0).predict(0) % 128 == 0
    assert sizer(smooth=1.0).predict(900_000) == 128  # floored at base // 4
    assert sizer(smooth=0.0).predict(50_000) == 512  # 0: static
    assert sizer(context_len=5000).predict(4850) is None  # context left - 100 < 64
    assert sizer(context_len=5000, smooth=0).predict(4540) == 320  # capped at 360, aligned down
    # each chunk costs about what the first did
    L, x = 2000, exact.predict(2000)  # (alignment to 64 tokens is the error)
    assert f(L + x) - f(L) == pytest.approx(f(512) - f(0), rel=0.25)


def test_sample_lengths_and_the_bounded_profile():
    assert sample_lengths(512, 4096)[0] == 640 and len(sample_lengths(512, 4096)) == 128
    assert len(sample_lengths(512, 4096, 24)) == 24
    timed: list[int] = []
    built = build_sizer(512, 1, 4096, 16384, 0.75, lambda n: timed.append(n) or f(n))
    assert built is not None and len(timed) == 24
    concave = build_sizer(512, 1, 4096, 16384, 0.75, lambda n: 50 - 1e-5 * n * n)
    assert concave is None  # a <= 0: no model, static chunks


def test_continuation_chunks_follow_the_sizer(core):
    """A 3,000-token prompt chunked by 512: with the sizer the later chunks shrink."""
    h = Harness(core, total_tokens=8192, chunked_prefill_size=512, disable_overlap_schedule=True)
    h.sched.prefill.sizer = ChunkSizer(CostModel(a=1e-3, b=0.1, c=1.0), 512, 1, 4096, 16384, 1.0)
    h.add("long", [3] * 3000, max_new_tokens=1)
    chunks = []
    while not h.results().get("long", {}).get("finish"):
        before = h.sched.prefill.chunked_req.kv_len if h.sched.prefill.chunked_req else 0
        h.sched.step()
        req = h.sched.prefill.chunked_req
        chunks.append((req.kv_len if req else 3000) - before)
    assert chunks[0] == 512
    assert all(b <= a for a, b in zip(chunks[:-2], chunks[1:-1])) and chunks[-2] < 512
    assert sum(chunks) == 3000


def test_the_start_up_profile_leaves_nothing_behind(core):
    """The profile's prefills go through the real row/slot lifecycle and give everything back."""
    h = Harness(core, total_tokens=2048, enable_dynamic_chunking=True, chunked_prefill_size=256)
    h.sched.cache.check_idle()
    assert h.allocator.available_size() == 2048
    h.add("after", [4] * 600, max_new_tokens=3)
    h.run()
    assert h.results()["after"]["finish"] == {"type": "length", "length": 3}
