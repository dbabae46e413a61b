#!/bin/bash
# xshare's GPU checks in one call of a lent GPU machine (first run: an H100, 2026-11-26; its
# output is benchmarks/results/gpu_h100_2026-11-26/, read in RESULTS.md "The first GPU run").
# Environment, the FFI fences built against that machine's jaxlib, `xshare doctor`, the tests
# that need CUDA or NVML, the self-test, the stop hook's side-by-side, the user tests on the
# GPU (default and deterministic XLA), the K table, and where the dispatcher's time goes.
# About 6 minutes on an H100. Its python3 holds jax with CUDA; what xshare needs besides
# (jsonschema, starlette, uvicorn and their needs) travels as wheels in .gpu/whl, and the hook
# as .gpu/sidebyside.py (both ignored by git: .git/info/exclude has /.gpu/):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu/whl jsonschema jsonschema-specifications \
#     referencing rpds-py starlette uvicorn;  cp ../shared/hooks/sidebyside.py .gpu/
# then run `bash benchmarks/gpu/check.sh 2>&1 | tee $OUT/log.txt` with .gpu carried.
PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# models/ installs as xshare.models (pyproject's package-dir); from a bare checkout, link it.
[ -e xshare/models ] || ln -s ../models xshare/models
if [ -d .gpu/whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
T0=$(date +%s)
phase() { echo; echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
phase env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import sys, jax, jaxlib, flax, optax, numpy; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
nproc; which nvcc g++
phase ffi-build
timeout 180 $PY -c "
import time; t=time.perf_counter()
from xshare import ffi
print('available', ffi.available(), ffi.unavailable_reason() if not ffi.available() else '', 'registered', sorted(ffi._state.registered), f'{time.perf_counter()-t:.1f}s')
" 2>&1 | tail -20
phase doctor
timeout 150 $PY -m xshare doctor --json > "$OUT/doctor.json" 2> /tmp/doctor.err; echo "doctor rc=$?"; tail -20 /tmp/doctor.err
phase gpu-tests
JAX_PLATFORMS=cuda,cpu timeout 200 $PY -m pytest -q -p no:cacheprovider --timeout 120 -rfs \
  tests/ffi/test_cuda_device.py tests/ffi/test_build.py tests/ffi/test_canary.py tests/status/test_nvml.py 2>&1 | tail -40
phase selftest
timeout 240 $PY -m xshare doctor --selftest --report "$OUT/selftest-gpu.md" 2>&1 | tail -45
if [ -f .gpu/sidebyside.py ]; then
  phase sidebyside
  timeout 150 $PY .gpu/sidebyside.py 8 400
  timeout 150 $PY .gpu/sidebyside.py 8 3000
  timeout 100 $PY .gpu/sidebyside.py 1 3000
  # The same with K-step programs allowed within a tolerance (on a GPU they are not
  # bit-identical, so by default every job stays at one step per call: RESULTS.md).
  sed 's/^WAYS = {/WAYS = {"pack_rtol": {"policy": "pack", "steps_per_call_rtol": 1e-5}, "fused_rtol": {"policy": "pack", "fuse": True, "steps_per_call_rtol": 1e-5}, /' \
    .gpu/sidebyside.py > /tmp/sidebyside_rtol.py
  SIDE_WAYS=pack_rtol,fused_rtol timeout 150 $PY /tmp/sidebyside_rtol.py 8 3000
  # An earlier commit side by side (a `git worktree` of it copied to .gpu/base, with
  # models/ linked in as xshare/models), for an A/B of a change on this machine.
  if [ -d .gpu/base/xshare ]; then
    PYTHONPATH=$PWD/.gpu/base:/tmp/site timeout 150 $PY .gpu/sidebyside.py 8 400 | sed 's/^/base: /'
  fi
  phase dispatcher-profile
  timeout 70 $PY benchmarks/gpu/prof.py .gpu/sidebyside.py 2>&1 | head -75
fi
phase users-on-gpu
JAX_PLATFORMS=cuda,cpu timeout 120 $PY -m pytest -q -p no:cacheprovider --timeout 100 tests/users 2>&1 | tail -25
JAX_PLATFORMS=cuda,cpu XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 120 $PY -m pytest -q -p no:cacheprovider \
  --timeout 100 tests/users 2>&1 | tail -15
phase steps_per_call
timeout 120 $PY -m benchmarks.steps_per_call --ks 1,4,16 --repeats 3 --steps 256 2>&1
phase end
