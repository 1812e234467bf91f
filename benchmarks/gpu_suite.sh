#!/usr/bin/env bash
# One command for a GPU machine (H100/H200, Python 3.12, jax 0.11.x, no network):
#
#   bash benchmarks/gpu_suite.sh            # ~9 minutes in all
#   QUICK=1 bash benchmarks/gpu_suite.sh    # smaller sweeps (~5 minutes)
#
# Stages, each under its own `timeout` and all inside one overall budget (SUITE_SECONDS, 540 s,
# under the device tool's 600 s per command), a failing stage does not stop the next. The stage
# limits (setup 90, env 60, gpu_tests 200, kernels 130 / QUICK 100, e2e 150 / QUICK 100,
# e2e_triton 90, fp8 60) are ceilings that sum past the budget: a stage gets at most what the
# budget leaves, so a stage that finishes early hands its time on and the last ones
# (e2e_triton, fp8) run on the remainder. gpu_tests has 200 s (was 150; e2e gave up 50) for the
# 95 compiled `pytest -m gpu` tests, 66 of them Mosaic GPU paged attention cases. The stages:
#   setup      carried wheels (.whl/*.whl -> /tmp/site) and the project itself, so that
#              `jaxserve.server` (the top-level folder server/, mapped by setuptools package-dir)
#              imports: an editable install, else /tmp/site-jaxserve/jaxserve made of links to
#              jaxserve/* plus server/ as jaxserve/server (first on PYTHONPATH)
#   env        GPU name/memory/driver, Python, jax/jaxlib, devices, backend, missing deps
#   gpu_tests  every test file with gpu-marked tests, `pytest -m gpu -q`
#   kernels    benchmarks/bench_paged_attention.py, trimmed sweep (all columns)
#   e2e        benchmarks/bench_gpu_e2e.py on a dummy Llama-3.1-8B (bf16), attention_backend mosaic
#              (the Mosaic GPU kernel; `auto` takes it only once measured: jaxserve/pallas/measured.py;
#              a compile failure falls back to the Triton kernel with a warning, printed in the block)
#   e2e_triton the same decode steps with attention_backend pallas (the Triton kernel), if time is left
#   fp8        benchmarks/bench_fp8_matmul.py (4096^3 and decode M=1..128 at N=K=8192; 8192^3 when
#              FP8_FULL=1); last, so it runs only on what the budget leaves (~60 s)
# then a markdown block for benchmarks/RESULTS.md. Everything is tee'd to $OUT/ (the device
# tool's folder) when set, else benchmarks/out/.
#
# The image has no package index. Wheels for missing pure deps can be carried in .whl/ (64 MiB
# in all), e.g. on a networked machine:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl flax tokenizers ...
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
budget=${SUITE_SECONDS:-540}
py=${PYTHON:-python3}   # PYTHON: another interpreter (a dry run off the GPU machine)

stage() {  # stage NAME SECONDS CMD... -- runs under min(SECONDS, what is left of the budget)
  local name=$1 secs=$2; shift 2
  local left=$((budget - SECONDS - 10))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -le 5 ]; then
    echo "=== $name: skipped (suite budget spent) ===" | tee "$out/$name.log"
    echo "| $name | skipped | 0 s |" >> "$out/stages.md"
    return
  fi
  echo "=== $name (limit ${secs}s) ==="
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  local verdict=$rc
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && verdict="$rc (time limit)"
  echo "=== $name: exit $verdict in $((SECONDS - t0)) s ==="
  echo "| $name | $verdict | $((SECONDS - t0)) s |" >> "$out/stages.md"
}

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing carried wheels into /tmp/site: $(ls .whl | tr '\n' ' ')"
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "carried wheels: install failed"
  fi
  if $py -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
    echo "project: editable install of $PWD"
  else   # no setuptools: the same package layout as links (jaxserve/* and jaxserve/server)
    rm -rf /tmp/site-jaxserve && mkdir -p /tmp/site-jaxserve/jaxserve
    ln -s "$PWD"/jaxserve/* /tmp/site-jaxserve/jaxserve/
    ln -s "$PWD/server" /tmp/site-jaxserve/jaxserve/server
    echo "project: no editable install; /tmp/site-jaxserve/jaxserve links the checkout"
  fi
}

echo "| stage | exit | time |" > "$out/stages.md"
echo "|---|---|---:|" >> "$out/stages.md"
stage setup 90 bash -c "$(declare -f setup); py=$py; setup"
# Carried wheels first, then the linked package if that was the route, then the checkout.
# PYTHONSAFEPATH: `python -m pytest` and `python -` would otherwise put the checkout (whose
# jaxserve/ has no server/) ahead of the linked package.
for d in /tmp/site-jaxserve /tmp/site; do
  [ -d "$d" ] && export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
done
[ -d /tmp/site-jaxserve ] && export PYTHONSAFEPATH=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

stage env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$py - <<'PY'
import importlib, sys
import jax, jaxlib
print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__)
print('backend', jax.default_backend(), '| devices', jax.devices())
missing = [m for m in ('numpy', 'flax', 'safetensors', 'tokenizers', 'jinja2', 'gguf', 'aiohttp',
                       'pydantic', 'prometheus_client', 'tqdm', 'xxhash', 'yaml', 'pytest')
           if importlib.util.find_spec(m) is None]
print('missing deps:', ', '.join(missing) or 'none')
import jaxserve, jaxserve.server
print('jaxserve from', jaxserve.__file__, '| jaxserve.server from', jaxserve.server.__file__)
PY"

gpu_tests=$(grep -l "mark\.gpu" tests/test_*.py | tr '\n' ' ')
# shellcheck disable=SC2086  # one word per file
stage gpu_tests 200 $py -m pytest -m gpu -q -p no:cacheprovider -rs $gpu_tests

if [ -n "${QUICK:-}" ]; then
  stage kernels 100 $py benchmarks/bench_paged_attention.py --kv auto --batches 1,32,256 \
    --contexts 512,8192 --iters 10
  stage e2e 100 $py benchmarks/bench_gpu_e2e.py --attention-backend mosaic --batches 1,64,256 --num-prompts 64 \
    --output-len 64
else
  stage kernels 130 $py benchmarks/bench_paged_attention.py --kv auto,fp8 --batches 1,32,256 \
    --contexts 512,8192
  stage e2e 150 $py benchmarks/bench_gpu_e2e.py --attention-backend mosaic --batches 1,8,32,128,256 \
    --num-prompts 128
fi
# The same decode steps on the Triton kernel (what `auto` picks on Hopper until Mosaic is measured):
stage e2e_triton 90 $py benchmarks/bench_gpu_e2e.py --attention-backend pallas --batches 1,64,256 \
  --num-prompts 16 --output-len 16
fp8_sizes=4096
[ -n "${FP8_FULL:-}" ] && fp8_sizes=4096,8192
stage fp8 60 $py benchmarks/bench_fp8_matmul.py --sizes "$fp8_sizes" --iters 10
# the int4 Mosaic GPU kernel beside XLA's int4 tiles and bf16 dense (after fp8: on what is left)
stage int4 40 $py benchmarks/bench_int4.py --kernel pallas --k 4096 --n 8192 --rows 1 16 64 256

{
  echo
  echo "## GPU suite, $(date -u +%F), $($py -c 'import jax; print(jax.devices()[0].device_kind)' 2>&1 | tail -1)"
  echo
  echo "$($py -c 'import sys, jax, jaxlib; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")' 2>&1 | tail -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
  echo "Command: \`${QUICK:+QUICK=1 }bash benchmarks/gpu_suite.sh\`"
  echo
  cat "$out/stages.md"
  echo
  echo "GPU tests: $(grep -E ' in [0-9.]+s' "$out/gpu_tests.log" | tail -1)"
  echo
  echo "### Paged attention kernels (decode)"
  echo
  grep -E '^(device:|\|)' "$out/kernels.log" 2>/dev/null
  echo
  sed -n '/^### End to end/,$p' "$out/e2e.log" 2>/dev/null
  echo
  sed -n '/^### End to end/,$p' "$out/e2e_triton.log" 2>/dev/null
  echo "### FP8 matmul"
  echo
  grep -E '^(device:|\||###)' "$out/fp8.log" 2>/dev/null
  echo
  echo "### int4 matmul (W4A16)"
  echo
  grep -E '^(rows|[ 0-9]+ \||NVIDIA|cuda)' "$out/int4.log" 2>/dev/null
} | tee "$out/results_block.md"
