"""Scheduler CPU cost with a null model: µs per decode step (64 / 256 running), µs per admission.

    python benches/bench_scheduler.py [--steps 200] [--out bench_results/scheduler.json]

The NullWorker answers instantly, so the time measured is the scheduler's own work: building
batches, allocating slots, processing results, streaming token ids (to a sink that drops
them). Targets with the Rust core: <= 1 ms per decode step at 256 running requests and
<= 50 µs per admitted request.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sglite.core  # noqa: E402
from fixtures.sched import TablePool  # noqa: E402
from sglite.config import ServerArgs  # noqa: E402
from sglite.messages import GenerateReq  # noqa: E402
from sglite.sampling_params import SamplingParams  # noqa: E402
from sglite.scheduler.scheduler import Scheduler  # noqa: E402
from sglite.scheduler.worker import NullWorker  # noqa: E402

TOTAL_TOKENS = 1 << 20
PROMPT_LEN = (200, 1000)


def build(core_name: str, page_size: int, max_running: int) -> Scheduler:
    core = sglite.core.load(core_name)
    args = ServerArgs(
        page_size=page_size,
        max_total_tokens=TOTAL_TOKENS,
        max_running_requests=max_running,
        disable_overlap_schedule=True,
        max_prefill_tokens=1 << 20,
        chunked_prefill_size=-1,
    )
    return Scheduler(
        args, NullWorker(32000), core=core,
        allocator=core.PageAllocator(TOTAL_TOKENS, page_size),
        req_to_token_pool=TablePool(max_running, 4096), context_length=4096,
        eos_token_ids=set(), decode_tail=lambda ids: "", send=lambda msg: None,
    )  # fmt: skip


def requests(n: int, seed: int, max_new: int) -> list[GenerateReq]:
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(256)] for _ in range(8)]
    out = []
    for i in range(n):
        own = [rng.randrange(32000) for _ in range(rng.randrange(*PROMPT_LEN))]
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        out.append(GenerateReq(f"r{i}", rng.choice(systems) + own, sp))
    return out


def bench(core_name: str, page_size: int, running: int, steps: int) -> dict:
    s = build(core_name, page_size, running)
    reqs = requests(running, 0, steps + 10)
    t0 = time.perf_counter()
    for r in reqs:
        s.add_request(r)
    while s.waiting:  # admission: prefill batches until every request runs
        s.step_normal()
    admit_s = time.perf_counter() - t0
    assert len(s.running) == running
    s.step_normal()  # warm-up decode
    t0 = time.perf_counter()
    for _ in range(steps):
        s.step_normal()
    decode_s = time.perf_counter() - t0
    return {
        "core": core_name, "page_size": page_size, "running": running,
        "us_per_decode_step": decode_s / steps * 1e6,
        "us_per_admitted_req": admit_s / running * 1e6,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="bench_results/scheduler.json")
    a = p.parse_args()
    cores = ["python"]
    if sglite.core._check_native(None, None)[0] is not None:
        cores.append("rust")
    rows = [bench(c, ps, n, a.steps) for c in cores for ps in (1, 16) for n in (64, 256)]
    print(f"{'core':<7}{'page':>5}{'running':>9}{'us/decode step':>16}{'us/admitted req':>17}")
    for r in rows:
        print(
            f"{r['core']:<7}{r['page_size']:>5}{r['running']:>9}"
            f"{r['us_per_decode_step']:>16.1f}{r['us_per_admitted_req']:>17.1f}"
        )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
