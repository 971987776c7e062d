#!/usr/bin/env bash
# The GPU check (issues 16 and 41), one prepared command of at most ~8 minutes on one H200:
#   1. the CUDA tests (pinned staging, fences as stream waits, a `.data` write refused by the device-side guard,
#      equivalence with ModelCheckpoint, FSDPStrategy(state_dict_type="sharded") equivalence and resume);
#   2. the exact guard's device-side fingerprint per GB (benchmarks/bench_cuda_guard.py);
#   3. O_DIRECT write rates (benchmarks/bench_direct.py) and CUDA-event step times around cuts plus a torch.profiler
#      window of the first fenced cut with its device-to-host copy rate (benchmarks/cuda_profile.py);
#   4. the side-by-side bench on CUDA (2.4 GB per checkpoint, a cut every 30 steps), JSON + markdown table;
#   5. restart after a kill from the local tier (disk, /dev/shm) vs the durable tier (benchmarks/gpu_restart.py).
# Files under OUTDIR (at most 8, for the device tool): log.txt, tests.log (every failure's whole traceback),
# profile.json, bench.{json,md,log}, restart.{json,log}.
# Runs from a plain checkout: the GPU machine has torch, lightning and accelerate but no package registry, so
# this package's other wheels (crc32c, ...) travel in .whl/ (see /work/.library/device/README.md) and the
# checkout is put on PYTHONPATH instead of being installed.
#
# Usage: benchmarks/gpu_check.sh [OUTDIR]      (default: $OUT when set, else ./gpu-check)
#        GPU_CHECK_ONLY="tests guard direct profile bench restart" runs a subset (default: all).
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
only=" ${GPU_CHECK_ONLY:-tests guard direct profile bench restart} "
want() { [[ "$only" == *" $1 "* ]]; }
rc=0
log="$out/log.txt"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  python3 -c "import accelerate; print('accelerate', accelerate.__version__)" || true
  nproc; free -g | head -2; df -h /tmp /dev/shm | tail -2
} >"$log" 2>&1
cat "$log"
t0=$SECONDS
stamp() { echo "   ($1 took $((SECONDS - t0)) s since start)" | tee -a "$log"; }

if want tests; then
  echo "== CUDA tests" | tee -a "$log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" -x --timeout 150 \
    tests/core/test_cuda_staging.py tests/lightning/test_cuda_equivalence.py tests/lightning/test_cuda_fsdp.py \
    ${GPU_CHECK_EXTRA_TESTS:-} -p no:warnings -rfE --tb=long 2>&1 | tee "$out/tests.log" | tail -25 | tee -a "$log" || rc=1
  stamp tests
fi

if want guard; then
  echo "== the exact guard on CUDA: device-side fingerprint per GB" | tee -a "$log"
  timeout 60 python3 benchmarks/bench_cuda_guard.py --sizes-mb 256 1024 2400 2>&1 | tee -a "$log" || rc=1
  stamp guard
fi

if want direct; then
  echo "== O_DIRECT writes: pipelined DirectFile vs the one-thread baseline vs the floor" | tee -a "$log"
  timeout 50 python3 benchmarks/bench_direct.py --dir /tmp --size-mb 2048 --rounds 1 2>&1 | tee -a "$log" || rc=1
  stamp direct
fi

if want profile; then
  echo "== step times around cuts (CUDA events) and a profile of the first fenced cut" | tee -a "$log"
  timeout 100 python3 benchmarks/cuda_profile.py --out "$out" --tmp /tmp --modes defer --steps 50 --every 20 \
    2>&1 | grep -v "^ " | tail -30 | tee -a "$log" || rc=1
  rm -f "$out/trace.json"
  stamp profile
fi

if want bench; then
  echo "== bench (CUDA, 2.4 GB per checkpoint)" | tee -a "$log"
  timeout 270 python3 -m lightning_async_ckpt bench --device cuda --param-mb 1000 --width 8192 --batch 4096 \
    --steps 100 --every 30 --modes none,model_checkpoint,async_checkpoint_io,dcp_async_save,ours_defer \
    --dir /tmp/lac-bench --json "$out/bench.json" --markdown "$out/bench.md" 2>&1 | tee "$out/bench.log" \
    | grep -E "^#|^\|" | tee -a "$log" || rc=1
  stamp bench
fi

if want restart; then
  echo "== restart after a kill: local tier (disk, /dev/shm) vs durable only" | tee -a "$log"
  timeout 240 python3 benchmarks/gpu_restart.py --repeats 2 --json "$out/restart.json" 2>&1 \
    | tee "$out/restart.log" | tail -12 | tee -a "$log" || rc=1
  stamp restart
fi
exit $rc
