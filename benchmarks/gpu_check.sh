#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: bash benchmarks/gpu_check.sh OUTDIR [--require-gpu]
#   1. the GPU test subset: tests/triton (Triton kernels forward/backward bit-exact against the torch reference,
#      every golden case and 64M-element random tensors) plus the tests that run on CUDA when it exists;
#   2. the kernel bandwidth benchmark (ratio to a device copy of the same bytes), with a plot;
#   3. an end-to-end run on a real model on the GPU (prepare, calibrate, learnable scales + QAT steps, fast
#      finetune, export; ONNX Runtime bit-exact per node; CUDA emulation == CPU emulation per quantizer).
# Writes OUTDIR/report.md plus the raw logs; every step runs even if an earlier one failed; exit 1 if any failed.
# Each step has a time limit so the whole check fits in about 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu_check}"
REQUIRE_GPU="${2:-}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
REPORT="$OUT/report.md"
FAILED=0

if ! "$PY" -c "import qtorch_onnx, torch" 2>/dev/null; then
  echo "installing the project into $($PY -c 'import sys; print(sys.executable)')"
  "$PY" -m pip install -q -e ".[test,examples]" > "$OUT/install.log" 2>&1 || { echo "install failed, see $OUT/install.log"; exit 1; }
  "$PY" -m pip install -q "triton>=3.8" >> "$OUT/install.log" 2>&1 || true
fi

GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
{
  echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  echo
  echo "- device: ${GPU:-none (CUDA not available)}"
  echo "- nvidia-smi: $(nvidia-smi -L 2>/dev/null | head -1 || echo 'not found')"
  echo "- $("$PY" -c "import torch, importlib.metadata as m
try:
    tv = m.version('triton')
except m.PackageNotFoundError:
    tv = 'absent'
print('torch', torch.__version__, '| triton', tv)" 2>/dev/null)"
  echo
} > "$REPORT"

step() {  # step NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  local log="$OUT/$name.log"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local status="PASS"
  if [ $rc -ne 0 ]; then status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"; FAILED=1; fi
  echo "- **$name**: $status in ${dt}s; log \`$log\`; last line: \`$(tail -n 1 "$log" | cut -c1-200)\`" >> "$REPORT"
  echo "$name: $status (${dt}s)"
}

if [ -z "$GPU" ]; then
  echo "- **GPU steps: SKIPPED** (no CUDA device here); the CPU smoke run below is not a GPU check" >> "$REPORT"
  step e2e_cpu_smoke 300 "$PY" benchmarks/gpu_e2e.py --device cpu --samples 4 --steps 2 --configs A8W8 --out "$OUT/e2e_cpu"
  if [ "$REQUIRE_GPU" = "--require-gpu" ]; then FAILED=1; echo "no GPU and --require-gpu given"; fi
else
  step triton_tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/triton -rs
  if grep -q "skipped" "$OUT/triton_tests.log"; then
    echo "- **WARNING**: some Triton tests were skipped on the GPU, see \`$OUT/triton_tests.log\` (-rs lists why)" >> "$REPORT"
  fi
  step cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/formats/test_ops.py tests/quant/test_block_quantizers.py -x
  step kernel_bandwidth 180 "$PY" benchmarks/block_formats.py --device cuda --sizes-mb 1 64 256 --compile --plot "$OUT/block_formats.png"
  step e2e_gpu 240 "$PY" benchmarks/gpu_e2e.py --device cuda --out "$OUT/e2e"
fi
echo >> "$REPORT"
echo "overall: $([ $FAILED -eq 0 ] && echo PASS || echo FAIL)" >> "$REPORT"
cat "$REPORT"
exit $FAILED
