"""sglite_kernels' per-layer variations against the plain torch reference: sliding windows
(shorter than, equal to and longer than the requests; prefixes the window skips, blocks
whose window starts mid-tile, windowed split counts), logit soft-caps and attention sinks,
page sizes 1 and 16, GQA; under the Triton interpreter on CPU, at full sizes on a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglite_kernels") is None:  # source checkout, not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from fixtures.kernel_cases import check_decode, check_extend, sinks_of  # noqa: E402
from sglite_kernels import interpreted  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _cpu_cases_need_the_interpreter(request):
    if request.node.get_closest_marker("gpu") is None and not interpreted():
        pytest.skip("CPU kernel cases need Triton's interpreter, off under SGL_TEST_GPU=1")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [1, 5, 20, 37, 64])
def test_decode_window(page_size, window):
    # windows shorter than, equal to and longer than the rows; splits of the windowed keys
    check_decode(
        [1, 37, 20, 50], 8, 2, 32, page_size, torch.float32, "cpu", [1, 3, 2, 3], 16,
        window=window,
    )  # fmt: skip


def test_decode_cap_andsinks_of():
    check_decode([3, 40], 4, 2, 16, 16, torch.float32, "cpu", [1, 3], 16, logit_cap=0.6)
    check_decode([3, 40], 4, 2, 16, 16, torch.float32, "cpu", [2, 3], 16, sinks=sinks_of(4))
    check_decode(
        [9, 70], 4, 1, 16, 1, torch.float32, "cpu", None, 16,
        window=24, logit_cap=1.5, sinks=sinks_of(4),
    )  # fmt: skip


def test_decode_bf16_window_andsinks_of():
    check_decode(
        [9, 30], 8, 1, 64, 16, torch.bfloat16, "cpu", [2, 2], 16, window=12, sinks=sinks_of(8)
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [1, 6, 21, 40])
def test_extend_window(page_size, window):
    # prefixes longer than the window (its first tiles skipped), fresh prompts crossing it,
    # a one-token row; tiles of 16 so that a block's window starts mid-tile
    check_extend(
        [0, 21, 35, 3], [40, 7, 1, 30], 4, 2, 32, page_size, torch.float32, "cpu", (16, 16),
        window=window,
    )  # fmt: skip


def test_extend_cap_andsinks_of():
    sinks = sinks_of(4)
    check_extend([0, 21], [19, 7], 4, 1, 16, 1, torch.float32, "cpu", (16, 16), logit_cap=0.7)
    check_extend([0, 21], [19, 7], 4, 1, 16, 1, torch.float32, "cpu", (16, 16), sinks=sinks)
    check_extend(
        [5, 0, 40], [12, 33, 1], 4, 2, 16, 16, torch.float32, "cpu", (16, 16),
        window=10, logit_cap=2.5, sinks=sinks,
    )  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [512, 4096])
def test_variants_gpu(page_size, window):
    # Gemma-like heads (8 over 4, head_dim 256) with a window, a soft cap and sinks
    variant = dict(window=window, logit_cap=50.0, sinks=sinks_of(8))
    lens = [1, 17, 300, 1024, 4096, 2047, 513, 5000] * 2
    check_decode(lens, 8, 4, 256, page_size, torch.bfloat16, "cuda", **variant)
    check_extend(
        [0, 700, 37, 2048, 1], [513, 1, 300, 128, 1000], 8, 4, 256, page_size,
        torch.bfloat16, "cuda", **variant,
    )  # fmt: skip
