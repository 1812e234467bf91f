#!/usr/bin/env bash
# One command for a GPU machine (H100/H200, jax 0.11.x, no network): environment check, the
# GPU tests, the paged attention kernel sweep and the end-to-end engine figures on a dummy
# Llama-3.1-8B. Each stage has its own time limit and a failing stage does not stop the next;
# everything is logged under $OUT (the device tool's folder) or benchmarks/out/.
#
#   bash benchmarks/gpu_suite.sh            # ~9 minutes
#   QUICK=1 bash benchmarks/gpu_suite.sh    # smaller sweeps
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then   # wheels carried for what the image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) ==="
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc in $((SECONDS - t0)) s ==="
  echo "| $name | $rc | $((SECONDS - t0)) s |" >> "$out/stages.md"
}

echo "| stage | exit | time |" > "$out/stages.md"
echo "|---|---:|---:|" >> "$out/stages.md"
stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__,
  jaxlib.__version__, jax.default_backend(), jax.devices())"'
gpu_tests=(tests/test_gpu.py)
[ -f tests/test_paged_attention_mgpu.py ] && gpu_tests+=(tests/test_paged_attention_mgpu.py)
stage gpu_tests 200 python3 -m pytest -m gpu -q -s -p no:cacheprovider "${gpu_tests[@]}"
if [ -n "${QUICK:-}" ]; then
  stage kernels 150 python3 benchmarks/bench_paged_attention.py --quick --kv auto,fp8
  stage e2e 240 python3 benchmarks/bench_gpu_e2e.py --batches 1,64,256 --num-prompts 128
else
  stage kernels 180 python3 benchmarks/bench_paged_attention.py --kv auto,fp8 \
    --batches 1,32,64,256 --contexts 512,2048,8192
  stage e2e 300 python3 benchmarks/bench_gpu_e2e.py
fi
echo; echo "## GPU suite, $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
cat "$out/stages.md"
