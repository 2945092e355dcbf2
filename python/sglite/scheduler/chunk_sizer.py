"""ChunkSizer: continuation chunks sized to cost what the first one did (--enable-dynamic-chunking).

A chunk's forward costs more as the prefix it attends to grows, so equal-token chunks of a long
prompt take longer and longer, and the decode rows that wait behind (or ride along with) each
one see their inter-token latency climb. SGLang's sizer (pipeline parallelism only there; here
wherever chunked prefill runs) fits a quadratic f(l) = a*l^2 + b*l + c once at start-up, on
timed real single-request prefills of lengths up to 1.25 x --chunked-prefill-size, and sizes
each continuation chunk x after a prefix of L tokens so that f(L + x) - f(L) equals the first
chunk's cost T = f(base) - f(0):
    x = (-(2aL + b) + sqrt((2aL + b)^2 + 4aT)) / 2a
then smooths it toward base (s = base + k (x - base), k = SGL_DYNAMIC_CHUNKING_SMOOTH_FACTOR,
default 0.75, floored at base // 4), aligns it down to max(page, 64) tokens, and caps it by the
context left (minus 100) and --max-prefill-tokens. None: use base. The first chunk of every
request is base; the prediction never exceeds it and falls as L grows. The fit needs 8 points
beyond the first (a warm-up outlier, dropped) and a > 0; a negative b is clamped to 0.
Nothing is refit at run time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

MIN_POINTS = 8
MAX_SAMPLES = 128
DEFAULT_SMOOTH_FACTOR = 0.75
CONTEXT_MARGIN = 100
MIN_ALIGN = 64


@dataclass(frozen=True)
class CostModel:
    a: float
    b: float
    c: float

    @staticmethod
    def fit(lengths: list[int], ms: list[float]) -> CostModel | None:
        """Least squares on the samples after the first; None when it cannot be used."""
        x, y = np.asarray(lengths[1:], dtype=float), np.asarray(ms[1:], dtype=float)
        if len(x) < MIN_POINTS:
            return None
        a, b, c = np.linalg.lstsq(np.stack([x * x, x, np.ones_like(x)], 1), y, rcond=None)[0]
        if not a > 0:
            return None
        if b < 0:
            logger.warning("dynamic chunking: the fit's linear term %.3g < 0, clamped to 0", b)
            b = 0.0
        return CostModel(float(a), float(b), float(c))


class ChunkSizer:
    def __init__(
        self,
        model: CostModel,
        base: int,
        page_size: int,
        context_len: int,
        max_prefill_tokens: int,
        smooth: float = DEFAULT_SMOOTH_FACTOR,
    ):
        self.model = model
        self.base = base
        self.align = max(page_size, MIN_ALIGN)
        self.context_len = context_len
        self.max_prefill_tokens = max_prefill_tokens
        self.smooth = smooth
        self.target = model.a * base * base + model.b * base  # f(base) - f(0)

    def predict(self, prefix_len: int) -> int | None:
        """The chunk budget for a continuation after `prefix_len` tokens (None: use base)."""
        a, target = self.model.a, self.target
        if target <= 0:
            return None
        lin = 2 * a * prefix_len + self.model.b
        disc = lin * lin + 4 * a * target
        # the positive root, written 2T / (B + sqrt(disc)) so a long prefix does not cancel
        x = 2 * target / (lin + math.sqrt(disc)) if disc >= 0 and lin + math.sqrt(disc) > 0 else 0.0
        if x <= 0:
            return None
        s = self.base + self.smooth * (x - self.base)
        size = max(int(s), self.base // 4)
        g = self.align
        size = max(size // g * g, g)
        size = min(size, self.context_len - prefix_len - CONTEXT_MARGIN, self.max_prefill_tokens)
        size = size // g * g
        return size if size >= g else None


def sample_lengths(base: int, context_len: int, num: int = MAX_SAMPLES) -> list[int]:
    """SGLang's grid, from M = min(1.25 base, context) down in steps of max(1, M // 128),
    thinned evenly to `num` lengths (the first, M, is the warm-up the fit drops)."""
    top = min(int(1.25 * base), context_len)
    step = max(1, top // MAX_SAMPLES)
    grid = [top - i * step for i in range(MAX_SAMPLES) if top - i * step > 0]
    if len(grid) <= num:
        return grid
    return [grid[round(i * (len(grid) - 1) / (num - 1))] for i in range(num)]


def profile(
    time_prefill: Callable[[int], float], lengths: list[int], budget_s: float
) -> tuple[list[int], list[float]]:
    """Time `time_prefill(length)` (ms) over `lengths`, stopping once `budget_s` is spent."""
    done, ms = [], []
    start = time.monotonic()
    for n in lengths:
        if time.monotonic() - start > budget_s:
            break
        ms.append(time_prefill(n))
        done.append(n)
    return done, ms


PROFILE_POINTS = 24  # timed prefills at start-up (one warm-up among them)
PROFILE_BUDGET_S = 30.0


def build_sizer(
    base: int,
    page_size: int,
    context_len: int,
    max_prefill_tokens: int,
    smooth: float,
    time_prefill: Callable[[int], float],
    agree: Callable[[object], object] | None = None,
) -> ChunkSizer | None:
    """Profile, fit and build (logged); None, with the reason logged, when the fit fails.
    Under TP every rank times the same forwards and takes rank 0's fit (`agree`)."""
    start = time.monotonic()
    lengths, ms = profile(
        time_prefill, sample_lengths(base, context_len, PROFILE_POINTS), PROFILE_BUDGET_S
    )
    model = CostModel.fit(lengths, ms)
    if agree is not None:
        model = agree(model)
    took = time.monotonic() - start
    if model is None:
        logger.warning(
            "dynamic chunking is off: %d timed prefills (%.1f s) gave no usable cost model",
            len(lengths), took,
        )  # fmt: skip
        return None
    sizer = ChunkSizer(model, base, page_size, context_len, max_prefill_tokens, smooth)
    logger.info(
        "dynamic chunking: f(l) = %.3g l^2 + %.3g l + %.3g ms from %d prefills in %.1f s; "
        "chunks after 0 / %d / %d tokens: %s / %s / %s",
        model.a, model.b, model.c, len(lengths), took, 4 * base, 16 * base,
        sizer.predict(0), sizer.predict(4 * base), sizer.predict(16 * base),
    )  # fmt: skip
    return sizer
