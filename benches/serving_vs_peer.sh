#!/usr/bin/env bash
# Serving benchmark, sglite vs a peer (vLLM's CPU server, llama.cpp's llama-server), same
# model, same client, same workloads (the two of the performance issue, and a small one for
# 7B models on 2 cores):
#   random: 64 prompts of 128-256 tokens, 32-64 output tokens, concurrency 32
#   shared: 4 system prompts of 1024 tokens x 16 questions of 128, 32 output, concurrency 16
#   small:  16 prompts of 64-128 tokens, 16-32 output tokens, concurrency 16
#
#   benches/serving_vs_peer.sh sglite [server flags...]   # .venv's sglite on the demo model
#   benches/serving_vs_peer.sh vllm                       # needs the peer venv (peers.md)
#   MODEL_FILE=x.gguf LLAMA_SERVER=/path/llama-server benches/serving_vs_peer.sh llama
#
# A .gguf for both: MODEL_DIR=x.gguf for sglite, MODEL_FILE=x.gguf for llama-server (which
# runs with -t THREADS (2), -np 16 slots of 256 tokens); TOKENIZER (default MODEL_DIR, or the
# demo model's folder when MODEL_DIR is a .gguf: benches/make_gguf.py's files carry its
# vocabulary) is the client's tokenizer.
#
# Appends one JSON line per workload to bench_results/serving.jsonl (tag: SERVER + TAG env),
# then `python benches/report.py bench_results/serving.jsonl` makes the table and plots.
# Environment: MODEL_DIR (default: the HF folder sglite converts the demo model into),
# VLLM_PY (default ~/.cache/peer-vllm/bin/python), PORT (30200), TAG, WORKLOADS
# ("random shared"), OUT (bench_results/serving.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
server=${1:?usage: serving_vs_peer.sh sglite|vllm [server flags...]}
shift
PY=.venv/bin/python
PORT=${PORT:-30200}
OUT=${OUT:-bench_results/serving.jsonl}
WORKLOADS=${WORKLOADS:-random shared}
MODEL_DIR=${MODEL_DIR:-$($PY -c 'from sglite.models.gguf import default_model_path; print(default_model_path())')}
case $MODEL_DIR in
*.gguf) TOKENIZER=${TOKENIZER:-$($PY -c 'from sglite.models.gguf import default_model_path; print(default_model_path())')} ;;
esac
TOKENIZER=${TOKENIZER:-$MODEL_DIR}
mkdir -p bench_results
log=bench_results/serving_$server.log

case $server in
sglite)
    $PY -m sglite.launch_server --model-path "$MODEL_DIR" --port "$PORT" "$@" >"$log" 2>&1 &
    ;;
vllm)
    VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} "${VLLM_PY:-$HOME/.cache/peer-vllm/bin/python}" \
        -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name smol \
        --dtype float32 --max-model-len 4096 --port "$PORT" "$@" >"$log" 2>&1 &
    ;;
llama)
    "${LLAMA_SERVER:?set LLAMA_SERVER to the llama-server binary}" -m "${MODEL_FILE:?set MODEL_FILE to the .gguf}" \
        -t "${THREADS:-2}" -np 16 -c 4096 --port "$PORT" "$@" >"$log" 2>&1 &
    ;;
*) echo "unknown server $server (sglite, vllm or llama)" >&2; exit 2 ;;
esac
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "$server died at start-up; see $log" >&2; exit 1; }
    sleep 1
done
echo "$server ready on port $PORT (log: $log)"

backend=$server
[ "$server" = llama ] && backend=openai
client=($PY -m sglite.bench_serving --backend "$backend" --port "$PORT" --tokenizer "$TOKENIZER"
        --output-file "$OUT" --disable-tqdm)
for w in $WORKLOADS; do
    case $w in
    random)
        "${client[@]}" --tag "$server${TAG:+ $TAG}" --dataset-name random --num-prompts 64 \
            --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 \
            --max-concurrency 32 --warmup-requests 2
        ;;
    shared)
        "${client[@]}" --tag "$server${TAG:+ $TAG}" --dataset-name generated-shared-prefix \
            --gsp-num-groups 4 --gsp-prompts-per-group 16 --gsp-system-prompt-len 1024 \
            --gsp-question-len 128 --gsp-output-len 32 --max-concurrency 16 \
            --warmup-requests 2 --flush-cache
        ;;
    small)
        "${client[@]}" --tag "$server${TAG:+ $TAG}" --dataset-name random --num-prompts 16 \
            --random-input-len 128 --random-output-len 32 --random-range-ratio 0.5 \
            --max-concurrency 16 --warmup-requests 1
        ;;
    *) echo "unknown workload $w" >&2; exit 2 ;;
    esac
done
