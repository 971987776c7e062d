#!/usr/bin/env bash
# The GPU check (issue 16), one prepared command of at most ~8 minutes on one H200:
#   1. the CUDA tests (staging into pinned buffers, fences as stream waits, GPU equivalence vs ModelCheckpoint);
#   2. O_DIRECT write rates (benchmarks/bench_direct.py) and CUDA-event step times around cuts plus a torch.profiler
#      table of one fenced cut (benchmarks/cuda_profile.py);
#   3. the side-by-side bench on CUDA (2.4 GB per checkpoint, a cut every 40 steps), JSON + markdown table.
# Files under OUTDIR (at most 8, for the device tool): log.txt, profile.json, trace.json.gz, bench.{json,md,log}.
# Runs from a plain checkout: the GPU machine has torch, lightning and accelerate but no package registry, so
# this package's other wheels (crc32c, ...) travel in .whl/ (see /work/.library/device/README.md) and the
# checkout is put on PYTHONPATH instead of being installed.
#
# Usage: benchmarks/gpu_check.sh [OUTDIR]      (default: $OUT when set, else ./gpu-check)
#        GPU_CHECK_SKIP="direct" skips the O_DIRECT comparison (when a lease has little time left).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
site=/tmp/lightning_async_ckpt-site
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="$PWD:$site"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
rc=0
log="$out/log.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} >"$log" 2>&1
cat "$log"

echo "== CUDA tests" | tee -a "$log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/core/test_cuda_staging.py tests/lightning/test_cuda_equivalence.py 2>&1 | tee -a "$log" || rc=1

if [[ " ${GPU_CHECK_SKIP:-} " != *" direct "* ]]; then
  echo "== O_DIRECT writes: pipelined DirectFile vs the one-thread baseline vs the floor" | tee -a "$log"
  timeout 60 python3 benchmarks/bench_direct.py --dir /tmp --size-mb 2048 --rounds 2 2>&1 | tee -a "$log" || rc=1
fi

echo "== step times around cuts (CUDA events) and a profile of the first fenced cut" | tee -a "$log"
timeout 130 python3 benchmarks/cuda_profile.py --out "$out" --tmp /tmp 2>&1 | tee -a "$log" || rc=1
[ -f "$out/trace.json" ] && gzip -f "$out/trace.json"

echo "== bench (CUDA, 2.4 GB per checkpoint)" | tee -a "$log"
timeout 340 python3 -m lightning_async_ckpt bench --device cuda --param-mb 1000 --width 8192 --batch 4096 \
  --steps 130 --every 40 --json "$out/bench.json" --markdown "$out/bench.md" 2>&1 | tee "$out/bench.log" || rc=1
exit $rc
