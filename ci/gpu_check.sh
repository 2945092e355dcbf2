#!/usr/bin/env bash
# The one prepared GPU check, for a lent H200 (Python 3.12 with its own torch and triton, no
# internet). Build the abi3 wheel on the CPU machine first (`bash ci/build_wheel.sh`, carried
# as dist/); without it the Python tree core is used. Writes logs and JSON under $OUT.
#   run: command="bash ci/gpu_check.sh", carry=["dist"]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/sglite-gpu-out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
export PYTHONPATH="$PWD/python:$PWD/kernels:$PWD/tests"
export SGL_TEST_GPU=1 TRITON_INTERPRET=0
log() { echo "[gpu_check] $*" | tee -a "$OUT/summary.log"; }

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
"$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))' \
  > "$OUT/versions.txt" 2>&1
log "versions: $(cat "$OUT/versions.txt")"
if ls dist/sglite-*.whl >/dev/null 2>&1; then
  mkdir -p "$OUT/site"
  "$PY" -m pip install -q --no-deps --target "$OUT/site" dist/sglite-*.whl \
    && cp "$OUT"/site/sglite/_core*.so python/sglite/ && log "native core installed from the wheel"
  rm -rf "$OUT/site"
fi
export SGL_TREE_CORE=auto
"$PY" -c 'import sglite.core as c; c.load(); print(c.describe())' 2>&1 | tee -a "$OUT/summary.log"

log "pytest -m gpu (fused MoE and quantized GEMMs apart, below)"
timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/test_moe_triton.py \
  --ignore=tests/test_quant_triton.py tests \
  > "$OUT/pytest_gpu.log" 2>&1
log "pytest exit $? : $(tail -n 1 "$OUT/pytest_gpu.log")"

log "pytest -m gpu tests/test_moe_triton.py (Triton fused MoE vs the fp32 reference)"
timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_triton.py \
  > "$OUT/pytest_moe_triton.log" 2>&1
log "fused MoE tests exit $? : $(tail -n 1 "$OUT/pytest_moe_triton.log")"

log "fused MoE kernel vs per-expert loops"
timeout 180 "$PY" benches/bench_moe_triton.py --out "$OUT/moe_triton.json" > "$OUT/moe_triton.log" 2>&1
log "fused MoE bench exit $? : $(tail -n 5 "$OUT/moe_triton.log")"

log "pytest -m gpu tests/test_quant_triton.py (FP8 / AWQ / GPTQ GEMMs at 4096x4096 vs the references)"
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_quant_triton.py \
  > "$OUT/pytest_quant_triton.log" 2>&1
log "quant GEMM tests exit $? : $(tail -n 1 "$OUT/pytest_quant_triton.log")"

log "quantized GEMMs vs bf16 matmul (TFLOP/s, GB/s)"
timeout 150 "$PY" benches/bench_quant_triton.py --iters 10 --out "$OUT/quant_triton.json" \
  > "$OUT/quant_triton.log" 2>&1
log "quant GEMM bench exit $? : $(tail -n 1 "$OUT/quant_triton.log")"

log "decode kernel bandwidth"
timeout 120 "$PY" benches/bench_decode_kernel.py --out "$OUT/decode_kernel.json" > "$OUT/decode_kernel.log" 2>&1
log "decode kernel exit $? : $(tail -n 2 "$OUT/decode_kernel.log")"

log "offline throughput (Qwen3-0.6B shape, random weights)"
timeout 300 "$PY" benches/bench_offline.py --out "$OUT/offline.json" > "$OUT/offline.log" 2>&1
log "offline exit $? : $(tail -n 3 "$OUT/offline.log")"
