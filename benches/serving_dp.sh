#!/usr/bin/env bash
# Data parallelism on one machine: the shared-prefix workload against --dp-size 1, --dp-size 2
# with round_robin and --dp-size 2 with cache_aware, same client (sglite.bench_serving).
# Throughput of dp 2 vs 1 only shows a speed-up when the replicas have their own cores or
# GPUs (on a 2-core box it measures the overhead); the cache hit rate shows what prefix
# affinity buys: round robin computes each system prompt on every replica.
#
#   benches/serving_dp.sh            # defaults: a reduced workload that runs in minutes on CPU
#
# Environment: PY (.venv/bin/python), MODEL_DIR (the demo model's HF folder), PORT (30300),
# OUT (bench_results/serving_dp.jsonl), NUM_GROUPS (4), PER_GROUP (8), SYS_LEN (512),
# Q_LEN (64), OUT_LEN (16), CONCURRENCY (8), MAX_TOTAL_TOKENS (16384 per replica).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-30300}
OUT=${OUT:-bench_results/serving_dp.jsonl}
MODEL_DIR=${MODEL_DIR:-$($PY -c 'from sglite.models.gguf import default_model_path; print(default_model_path())')}
mkdir -p bench_results
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; wait 2>/dev/null || true' EXIT

run() {  # run TAG [server flags...]
    local tag=$1
    shift
    local log=bench_results/serving_dp_${tag// /_}.log
    $PY -m sglite.launch_server --model-path "$MODEL_DIR" --port "$PORT" \
        --max-total-tokens "${MAX_TOTAL_TOKENS:-16384}" "$@" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 900); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "server died at start-up; see $log" >&2; exit 1; }
        sleep 1
    done
    $PY -m sglite.bench_serving --backend sglite --port "$PORT" --tokenizer "$MODEL_DIR" \
        --output-file "$OUT" --disable-tqdm --tag "$tag" --dataset-name generated-shared-prefix \
        --gsp-num-groups "${NUM_GROUPS:-4}" --gsp-prompts-per-group "${PER_GROUP:-8}" \
        --gsp-system-prompt-len "${SYS_LEN:-512}" --gsp-question-len "${Q_LEN:-64}" \
        --gsp-output-len "${OUT_LEN:-16}" --max-concurrency "${CONCURRENCY:-8}" \
        --warmup-requests 2 --flush-cache
    kill $pid
    wait $pid || true
    pid=
}

run "dp1" --dp-size 1
run "dp2 round_robin" --dp-size 2 --load-balance-method round_robin
run "dp2 cache_aware" --dp-size 2 --load-balance-method cache_aware
