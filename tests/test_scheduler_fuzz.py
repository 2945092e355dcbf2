"""Scheduler fuzz: random workloads, configurations and aborts against a fake model whose K/V
catches bookkeeping bugs (tests/fixtures/chain_worker.py).

Each case draws a configuration (page size 1/4/16, a KV pool from barely-fits to roomy, every
policy, both loops, mixed chunk, chunk size, conservativeness, max-running, radix cache and
eviction policy, the shared or the mirrored request table, an eager or a lazy worker) and a
workload (shared prefixes, staggered arrivals, twins that compute the same fresh prefix in one
batch, revisits that arrive while a launched batch still reads rows just rewritten (with HiCache:
loading back an evicted prompt at once), EOS, stop ids and stop strings, requests that cannot
fit, aborts by exact id or by prefix in every request state). It checks that every request ends exactly once with the right
reason and the outputs of a run of that request alone, that nothing is refused for memory
(503) that fits alone, that KV conservation holds after every step, and the idle invariant at
the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from fixtures.chain_worker import ChainWorker, check_tree, make_lazy, reference_tokens
from fixtures.sched import Harness
from sglite.scheduler.worker import WorkerClient

NUM_CASES = 150  # per backend; each case is a few hundred scheduler steps
POLICIES = ["fcfs", "lpm", "dfs-weight", "lof", "random", "hrrn", "shortest-prefill-first"]
EOS = 2
CONTEXT = 1024
MAX_STEPS = 20_000
SLACK = [0, 1, 16, 48, 100, 300, 3000]  # KV pool beyond what the largest request needs
TWIN_SHARE = 0.1  # requests that arrive with a twin sharing a fresh 16..31-token prefix
OVERLAP_SHARE = 0.6  # cases run by the overlap loop
MIRRORED_SHARE = 0.25  # cases with the mirrored request table (the CUDA path)
LAZY_SHARE = 0.6  # cases whose worker runs a batch as late as possible
WINDOW_WAIT = 30


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    sp: dict
    arrive: int  # step at which it is submitted
    parent: str | None = None  # a follow-up turn: prompt = parent's prompt + output + own
    # a revisit (an earlier prompt + this tail) waits up to WINDOW_WAIT steps for the overlap
    # loop's window: a prefill's result was just processed while the next batch, launched,
    # still reads the old rows; with HiCache the device cache is then evicted (as if by
    # other requests) and it takes the earlier prompt with the longest host-only prefix, so
    # that its admission loads back at once
    revisit: list[int] | None = None


def draw_config(rng: random.Random, pressure: bool) -> dict:
    """`pressure`: eager admission of everything at once into a tight pool (it retracts)."""
    ps = rng.choice([1, 4, 16])
    chunk = rng.choice([-1, ps, 2 * ps, 32, 64, 128])
    chunk = chunk if chunk == -1 else max(chunk // ps, 1) * ps
    cfg = dict(
        page_size=ps,
        schedule_policy=rng.choice(POLICIES),
        disable_overlap_schedule=rng.random() >= OVERLAP_SHARE,
        enable_mixed_chunk=rng.random() < 0.5,
        chunked_prefill_size=chunk,
        max_prefill_tokens=rng.choice([16, 64, 256, 4096]),
        schedule_conservativeness=rng.choice([0.02, 0.05, 0.1, 0.3, 1.0]),
        max_running_requests=rng.choice([None, None, 1, 3, 16]),
        disable_radix_cache=rng.random() < 0.15,
        radix_eviction_policy=rng.choice(["lru", "lfu", "fifo", "priority"]),
    )
    if pressure:
        cfg.update(
            schedule_conservativeness=0.02,
            max_running_requests=None,
            max_prefill_tokens=4096,
            chunked_prefill_size=rng.choice([-1, 64, 128]),
        )
    return cfg


def draw_workload(rng: random.Random, vocab: int, pressure: bool) -> list[Spec]:
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 90))] for _ in range(3)]
    specs = []
    step = 0
    for i in range(rng.randrange(4, 32)):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]
        prompt = (rng.choice(systems) if rng.random() < 0.7 else []) + own
        # a follow-up turn reads the KV of its parent's output (published at its finish)
        firsts = [s.rid for s in specs if s.parent is None and s.revisit is None]
        parent = rng.choice(firsts) if firsts and rng.random() < 0.4 else None
        sp: dict = {"max_new_tokens": rng.choice([0, 1, 4, 20, 40, 80, 80])}
        if rng.random() < 0.15 and not pressure:  # reserved exactly: never retracted
            sp["ignore_eos"] = True
        if rng.random() < 0.2:
            sp["stop_token_ids"] = [rng.randrange(3, vocab)]
        if rng.random() < 0.15:
            sp["stop"] = [f"<{rng.randrange(3, vocab)}>"]
        if rng.random() < 0.1 and sp["max_new_tokens"] >= 3:
            sp["min_new_tokens"] = 3
        step += 0 if pressure else rng.choice([0, 0, 0, 1, 3, 10])
        specs.append(Spec(f"q{i:02d}", prompt, sp, step, parent))
        if rng.random() < TWIN_SHARE:
            # a twin arriving with it: both compute the same fresh 16..31 tokens in one
            # prefill batch (under the in-batch prefix gate), so processing that batch
            # frees one copy while the next batch, launched, may still read it
            fresh = [rng.randrange(3, vocab) for _ in range(rng.randrange(16, 32))]
            specs[-1].prompt, specs[-1].parent = fresh + own, None
            tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 8))]
            specs.append(Spec(f"q{i:02d}t", fresh + tail, dict(sp), step))
            # and soon after, a request that may find an earlier prompt in the host tier
            # (HiCache): its load-back writes the slots it gets at once
            again = rng.choice(specs[:-2] or specs)
            tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 4))]
            specs.append(Spec(f"q{i:02d}r", again.prompt + tail, dict(sp), step, revisit=tail))
    return specs


def pool_tokens(rng: random.Random, specs: list[Spec], ps: int, pressure: bool) -> int:
    """From barely fitting the largest request to roomy (a whole number of pages)."""
    by_rid = {s.rid: s for s in specs}

    def need(spec: Spec) -> int:  # a follow-up's prompt holds its parent's prompt and output
        own = len(spec.prompt) + spec.sp["max_new_tokens"]
        return own + (need(by_rid[spec.parent]) if spec.parent else 0)

    total = max(need(s) for s in specs) + ps + 1 + rng.choice(SLACK[:3] if pressure else SLACK)
    if pressure:  # room for a few typical requests, not for all of them
        needs = sorted(need(s) for s in specs)
        total = max(total, rng.choice([2, 3, 4]) * needs[len(needs) // 2])
    return -(-total // ps) * ps


def run_alone(core, spec: Spec, vocab: int) -> tuple[list[int], dict]:
    h = Harness(core, total_tokens=CONTEXT * 2, context_length=CONTEXT, eos=[EOS])
    worker = ChainWorker(h.sched.cache.table, CONTEXT * 2 + 16, vocab)
    h.sched.client = WorkerClient(worker, overlap=False)
    h.add(spec.rid, spec.prompt, **spec.sp)
    h.run()
    res = h.results()[spec.rid]
    # the lone run itself must be right: a prefix of the model's greedy continuation
    assert res["ids"] == reference_tokens(worker, spec.prompt, len(res["ids"]))
    return res["ids"], res["finish"]


def kv_holders(sched) -> list:
    reqs = list(sched.running) + [r for r, _ in sched.releasing.values()]
    if sched.prefill.chunked_req is not None:
        reqs.append(sched.prefill.chunked_req)
    unique = {id(r): r for r in reqs if r.row is not None}
    return list(unique.values())


def run_case(core, seed: int) -> dict:
    rng = random.Random(seed)
    pressure = rng.random() < 0.4
    vocab = 256 if pressure else rng.choice([16, 48, 256])  # EOS ends one after ~vocab tokens
    cfg = draw_config(rng, pressure)
    specs = draw_workload(rng, vocab, pressure)
    ps = cfg["page_size"]
    total = pool_tokens(rng, specs, ps, pressure)
    rows = 24 if pressure else rng.choice([2, 24, 24])
    h = Harness(core, total_tokens=total, context_length=CONTEXT, eos=[EOS], rows=rows, **cfg)
    sched = h.sched
    worker = ChainWorker(sched.cache.table, total + ps, vocab)
    if (
        rng.random() < MIRRORED_SHARE
    ):  # the CUDA path: a host mirror whose rows travel with each batch
        sched.cache.table = np.zeros_like(sched.cache.table)
        sched.cache.mirrored = True
        worker.table = None
    sched.client = WorkerClient(worker, overlap=False)
    lazy = rng.random() < LAZY_SHARE
    if lazy:
        make_lazy(sched.client)
    cap = sched.cache.allocator.capacity()
    limit = core.PrefillBudget.max_new_tokens_limit

    # a few requests that can never fit: refused at once (400), never queued
    too_big = []
    if rng.random() < 0.3:
        n = rng.randrange(1, 20)
        bad = Spec("big", [5] * n, {"max_new_tokens": limit(cap, ps, n) + 1}, 0)
        too_big.append(bad)

    step_fn = sched.step
    pending = sorted(specs + too_big, key=lambda s: s.arrive)
    by_rid = {spec.rid: spec for spec in specs}
    aborted: dict[str, int] = {}  # rids an abort hit while they were unfinished
    step = 0
    last_launched = None  # the batch in flight at the previous step
    while pending or sched.has_work():
        launched = sched.pending[0] if sched.pending else None
        window = bool(launched and last_launched and last_launched.is_extend)
        window = window and launched is not last_launched
        last_launched = launched
        while pending and pending[0].arrive <= step:
            spec = pending[0]
            if spec.revisit is not None:
                if not (window and not sched.waiting) and step < spec.arrive + WINDOW_WAIT:
                    break
                spec.prompt = host_revisit(sched, specs, h.results(), spec, limit(cap, ps, 0))
            if spec.parent is not None:
                parent = h.results().get(spec.parent)
                if parent is None or parent["finish"] is None:
                    break  # arrives once its parent turn has finished
                spec.prompt = by_rid[spec.parent].prompt + parent["ids"] + spec.prompt
            pending.pop(0)
            h.add(spec.rid, spec.prompt, **spec.sp)
        if rng.random() < 0.02:
            abort_something(rng, h, aborted)
        step_fn()
        sched.cache.check_conservation(kv_holders(sched))
        step += 1
        assert step < MAX_STEPS, f"no progress after {step} steps (a hang): {cfg}"
    h.run()  # idle: the invariant of an empty scheduler

    res = h.results()
    if not cfg["disable_radix_cache"]:
        check_tree(worker, sched.cache.tree, [s.prompt + res[s.rid]["ids"] for s in specs])
    for spec in too_big:
        assert res[spec.rid]["finish"]["status_code"] == 400
        assert "never fit" in res[spec.rid]["finish"]["message"] or cap > CONTEXT
    for spec in specs:
        got = res[spec.rid]
        assert got["n_finish"] == 1, (spec.rid, cfg)
        ids, finish = run_alone(core, spec, vocab)
        reason = got["finish"]
        assert reason.get("status_code") != 503, (spec.rid, reason, cfg)
        if spec.rid in aborted:
            assert reason["type"] == "abort" and reason["status_code"] == 499, (spec.rid, cfg)
            assert got["ids"] == ids[: len(got["ids"])], (spec.rid, cfg, lazy)
        else:
            assert (got["ids"], reason) == (ids, finish), (spec.rid, cfg, lazy, total)
    return {
        "retracted": sched.counters["num_retracted_reqs"],
        "whole_life": sched.counters["num_whole_life_reqs"],
        "aborted": len(aborted),
        "cfg": cfg,
        "total": total,
        "rows": rows,
        "steps": step,
        "tokens": sched.counters["num_generated_tokens_total"],
        "evicted": sched.cache.num_evicted_tokens,
    }


def host_revisit(sched, specs: list[Spec], results: dict, spec: Spec, room: int) -> list[int]:
    """The revisit's prompt: with a host tier, the finished prompt (+ its tail) whose
    host-only continuation is the longest, if one is long enough to be loaded back (and
    prompt + max_new_tokens fits in `room` tokens)."""
    prompt = spec.prompt
    if not sched.cache.tier.enabled:
        return prompt
    sched.cache.evict_for(sched.cache.allocator.capacity())  # others' pressure: all to host
    best = 0
    for s in specs:
        fits = len(s.prompt) + len(spec.revisit) + spec.sp["max_new_tokens"] <= room
        if fits and s.revisit is None and results.get(s.rid, {}).get("finish") is not None:
            key = np.asarray(s.prompt, dtype=np.int64)
            host = len(sched.cache.tree.match_prefix_host(key)[2])
            if host > best:
                best, prompt = host, s.prompt + spec.revisit
    return prompt if best >= 16 else spec.prompt


def abort_something(rng: random.Random, h: Harness, aborted: dict[str, int]) -> None:
    """Abort one request picked by state (waiting, chunked, running, finishing in flight)."""
    s = h.sched
    groups = {
        "waiting": list(s.waiting),
        "chunked": [s.prefill.chunked_req] if s.prefill.chunked_req else [],
        "running": [r for r in s.running if not r.finished and not r.finishing_in_flight],
        "finishing": [r for r in s.running if not r.finished and r.finishing_in_flight],
    }
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return
    target = rng.choice(groups[rng.choice(sorted(groups))])
    # by exact id, by its id as a prefix (it alone, or with its twin q07t), or rarely by a
    # family prefix (q1 aborts q10..q19)
    exact, prefix = rng.random() < 0.6, target.rid
    if not exact and rng.random() < 0.15:
        prefix = target.rid[:-1]
    finished = {rid for rid, r in h.results().items() if r["finish"] is not None}
    for r in s.waiting + s.running + groups.get("chunked", []):
        if r.rid not in finished and (r.rid == prefix or (not exact and r.rid.startswith(prefix))):
            aborted.setdefault(r.rid, 0)
    s.abort(prefix, exact=exact)


@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_scheduler_fuzz(core, seed):
    run_case(core, seed)


def test_the_fuzz_reaches_the_drained_budget(core):
    """Cases whose budget estimate was spent while memory was free, so requests were admitted
    by the whole-life rule (scheduler/admission.py), and every check above held (a quarter of
    the cases; these seeds are three of them)."""
    assert all(run_case(core, seed)["whole_life"] > 0 for seed in (16, 25, 28))


@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_capacity_boundary_never_hangs(core, loop, page_size):
    """Item 1 of the robustness issue: a request with prompt + max_new == capacity -
    page_size used to pass validation and be refused by admission forever, blocking the
    FCFS queue. One rule decides now: the limit is admitted, one more token is refused."""
    from sglite.server.inputs import InputProcessor

    total = 256
    prompt = list(range(3, 43))
    limit = core.PrefillBudget.max_new_tokens_limit(total, page_size, len(prompt))
    assert limit == total - page_size - len(prompt) - 1
    inputs = InputProcessor(
        None, context_length=4096, vocab_size=1000, max_total_tokens=total, page_size=page_size
    )
    assert inputs.max_new_tokens_limit(len(prompt)) == limit  # validation: the same rule
    for max_new in (limit, limit + 1):
        h = Harness(
            core,
            total_tokens=total,
            page_size=page_size,
            disable_overlap_schedule=loop == "normal",
        )
        h.add("edge", prompt, max_new_tokens=max_new, ignore_eos=True)
        h.add("behind", [7, 8, 9], max_new_tokens=3)
        h.run()
        res = h.results()
        if max_new == limit:
            assert res["edge"]["finish"] == {"type": "length", "length": limit}
        else:
            assert res["edge"]["finish"]["status_code"] == 400
        assert res["behind"]["finish"]["type"] == "length"


def test_unadmittable_head_is_refused_not_retried_forever(core):
    """The safety net: a request that slipped past validation and cannot be admitted even
    into the idle KV cache is finished with an error, and the queue behind it moves."""
    from sglite.sampling_params import SamplingParams
    from sglite.scheduler.req import Req

    h = Harness(core, total_tokens=128)
    h.sched.waiting.append(Req("stuck", [5] * 100, SamplingParams(max_new_tokens=100)))
    h.add("next", [6] * 10, max_new_tokens=4)
    h.run()
    res = h.results()
    assert res["stuck"]["finish"]["status_code"] == 400
    assert "idle KV cache" in res["stuck"]["finish"]["message"]
    assert res["next"]["finish"]["type"] == "length"


def test_finished_request_keeps_its_row_until_its_last_batch_ran(core):
    """Item 4 of the robustness issue, made deterministic with a lazy worker: A finishes by
    a stop token while its next decode row is launched; C then takes a free row at once.
    A's row must not be C's yet when that decode row runs, or the K/V it writes for A's last
    position (published into the tree at A's finish) is computed from C's slots, and a
    follow-up turn D that reuses A's output reads it."""
    vocab = 48
    h = Harness(core, total_tokens=512, eos=[EOS], max_running_requests=1, rows=2)
    worker = ChainWorker(h.sched.cache.table, 512 + 1, vocab)
    h.sched.client = WorkerClient(worker, overlap=False)
    make_lazy(h.sched.client)
    prompt_a = [5, 9, 11, 13, 17, 19, 23, 29]
    ref = reference_tokens(worker, prompt_a, 40)
    k = next(i for i in range(3, 40) if ref[i] not in ref[:i])
    k = min([k] + [i for i in range(k) if ref[i] == EOS])  # it stops at EOS or ref[k]
    h.add("a", prompt_a, max_new_tokens=40, stop_token_ids=[ref[k]])
    h.add("c", [31 + i % 7 for i in range(60)], max_new_tokens=3)
    h.run()
    out_a = h.results()["a"]["ids"]
    assert out_a == ref[: k + 1]
    follow = prompt_a + out_a + [7]
    h.add("d", follow, max_new_tokens=4, ignore_eos=True)
    h.run()
    assert h.results()["d"]["cached"] >= len(prompt_a) + k  # it did read A's output KV
    assert h.results()["d"]["ids"] == reference_tokens(worker, follow, 4)


def test_no_503_while_a_finisher_in_flight_frees_memory(core):
    """Item 3: in the overlap loop, b's last token is in flight when a needs a slot and none
    is free. Memory is about to be freed: the decode step is skipped (SGLang's choice), a is
    neither retracted nor aborted with 503 as if it could not fit alone."""
    h = Harness(core, total_tokens=27, schedule_conservativeness=0.05)
    h.add("a", list(range(3, 7)), max_new_tokens=12)
    for _ in range(2):
        h.sched.step_overlap()
    h.add("b", list(range(50, 58)), max_new_tokens=8)
    h.run()
    res = h.results()
    assert res["a"]["finish"] == {"type": "length", "length": 12}
    assert res["b"]["finish"] == {"type": "length", "length": 8}
    assert h.sched.counters["num_retracted_reqs"] == 0
