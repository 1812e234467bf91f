#!/usr/bin/env bash
# The first GPU session's first commands (H100/H200, Python 3.12, jax 0.11.x, no network), in two
# device calls of under 10 minutes each (the device tool's per-command limit), ~18 minutes in all:
#
#   bash benchmarks/gpu_wheels.sh                  # HERE, with network: .whl/ (carry it)
#   bash benchmarks/gpu_suite.sh                   # part 1, kernels    (~9 min; carry .whl)
#   PART=2 bash benchmarks/gpu_suite.sh            # part 2, end to end (~9 min; carry .whl)
#   DRY_RUN=1 PYTHON=~/.cache/jaxserve-ci/py312/bin/python bash benchmarks/gpu_suite.sh
#       # off the GPU: both parts with tiny shapes on CPU (interpret mode, tiny-llama), checking
#       # every stage's command line and the results block; ~15 min on a 2-core machine
#
# Stages, each under its own `timeout` and all inside one budget per part (SUITE_SECONDS, 560 s,
# under the device tool's 600 s), a failing stage does not stop the next. A stage's limit is a
# ceiling: it gets at most what the budget leaves, so one that ends early hands its time on.
# Part 1 (kernels):
#   setup      carried wheels (.whl/*.whl -> /tmp/site; benchmarks/gpu_wheels.txt lists what the
#              image lacks) and the project itself, so that `jaxserve.server` (the top-level
#              folder server/, mapped by setuptools package-dir) imports: an editable install,
#              else /tmp/site-jaxserve/jaxserve made of links to jaxserve/* plus server/
#   env        GPU name/memory/driver, Python, jax/jaxlib, devices, backend, missing deps
#   gpu_tests  every test file with gpu-marked tests, `pytest -m gpu -q` (the Mosaic GPU paged
#              attention's compiled parity cases among them)
#   kernels    benchmarks/bench_paged_attention.py: decode at batch 1/32/256 x context 512/8k,
#              bf16 and fp8 KV; columns: the Mosaic GPU kernel, the Triton ragged kernel, split-K,
#              the XLA reference path, jax's own Triton paged attention; HBM fraction
#   fp8        benchmarks/bench_fp8_matmul.py: FP8 GEMM (our kernel, XLA fp8) vs dequant + bf16
#   int4       benchmarks/bench_int4.py: the int4 Mosaic GPU kernel beside XLA and bf16
# Part 2 (end to end, dummy Llama-3.1-8B weights, no checkpoint travels):
#   e2e        benchmarks/bench_gpu_e2e.py, bf16, attention_backend mosaic: decode step roofline at
#              batch 1/32/256, prefill MFU, offline throughput (`auto` takes Mosaic only once
#              measured: jaxserve/pallas/measured.py; a compile failure falls back to the Triton
#              kernel with a warning, printed in the block)
#   e2e_fp8    the same with --quantization fp8
#   bench_bf16 `jaxserve bench latency` at batch 1 and `jaxserve bench throughput` at saturation
#   bench_fp8  the same with --quantization fp8
#   e2e_triton the decode steps on the Triton kernel (what `auto` picks on Hopper today), last
# Each part ends with a markdown block for benchmarks/RESULTS.md. Everything is tee'd to $OUT/
# (the device tool's folder) when set, else benchmarks/out/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}   # PYTHON: another interpreter (a dry run off the GPU machine)
part=${PART:-1}
case "$part" in 1|2) ;; *) echo "PART must be 1 or 2, got $part" >&2; exit 2 ;; esac
if [ -n "${DRY_RUN:-}" ]; then   # CPU: tiny shapes, interpret mode, stage limits x6
  budget=${SUITE_SECONDS:-3000}; scale=6
  cpu=(--allow-cpu); model=tests/data/tiny-llama
else
  budget=${SUITE_SECONDS:-560}; scale=1
  cpu=(); model=benchmarks/configs/llama-3.1-8b
fi

stage() {  # stage NAME SECONDS CMD... -- runs under min(SECONDS, what is left of the budget)
  local name=$1 secs=$(($2 * scale)); shift 2
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
    echo "installing carried wheels into $site: $(ls .whl | tr '\n' ' ')"
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .whl/*.whl || echo "carried wheels: install failed"
  fi
  if [ -n "$dry" ]; then   # off the GPU machine: leave the interpreter's installs alone
    echo "project: dry run, the checkout on PYTHONPATH (its jaxserve/server link)"
  elif $py -m pip install -q --no-index --no-deps --no-build-isolation -e . ; then
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
site=/tmp/site; links=/tmp/site-jaxserve
[ -n "${DRY_RUN:-}" ] && site="$(cd "$out" && pwd)/site" && links=none   # a dry run keeps out of /tmp
stage setup 90 bash -c "$(declare -f setup); py=$py; site=$site; dry=${DRY_RUN:-}; setup"
# Carried wheels first, then the linked package if that was the route, then the checkout.
# PYTHONSAFEPATH: `python -m pytest` and `python -` would otherwise put the checkout (whose
# jaxserve/ has no server/) ahead of the linked package.
for d in "$links" "$site"; do
  [ -d "$d" ] && export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
done
[ -d "$links" ] && export PYTHONSAFEPATH=1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

stage env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$py - <<'PY'
import importlib, sys
import jax, jaxlib
print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', jaxlib.__version__)
print('backend', jax.default_backend(), '| devices', jax.devices())
missing = [m for m in ('numpy', 'flax', 'safetensors', 'tokenizers', 'jinja2', 'gguf', 'aiohttp', 'jiter', 'llguidance',
                       'pydantic', 'prometheus_client', 'tqdm', 'xxhash', 'yaml', 'pytest')
           if importlib.util.find_spec(m) is None]
print('missing deps:', ', '.join(missing) or 'none')
import jaxserve, jaxserve.server
print('jaxserve from', jaxserve.__file__, '| jaxserve.server from', jaxserve.server.__file__)
PY"

if [ "$part" = 1 ]; then
  gpu_tests=$(grep -l "mark\.gpu" tests/test_*.py | tr '\n' ' ')
  collect=(); [ -n "${DRY_RUN:-}" ] && collect=(--collect-only)   # no GPU: the selection only
  # shellcheck disable=SC2086  # one word per file
  stage gpu_tests 200 $py -m pytest -m gpu -q -p no:cacheprovider -rs "${collect[@]}" $gpu_tests
  if [ -n "${DRY_RUN:-}" ]; then
    stage kernels 100 $py benchmarks/bench_paged_attention.py --allow-cpu --quick --kv auto,fp8
    stage fp8 60 $py benchmarks/bench_fp8_matmul.py --allow-cpu --sizes 256 --decode-n 256 \
      --decode-m 1,8 --iters 2
    stage int4 40 $py benchmarks/bench_int4.py --kernel pallas --interpret --k 256 --n 256 --rows 1 8
  else
    stage kernels 200 $py benchmarks/bench_paged_attention.py --kv auto,fp8 --batches 1,32,256 \
      --contexts 512,8192
    fp8_sizes=4096
    [ -n "${FP8_FULL:-}" ] && fp8_sizes=4096,8192
    stage fp8 60 $py benchmarks/bench_fp8_matmul.py --sizes "$fp8_sizes" --iters 10
    stage int4 40 $py benchmarks/bench_int4.py --kernel pallas --k 4096 --n 8192 --rows 1 16 64 256
  fi
else
  if [ -n "${DRY_RUN:-}" ]; then
    e2e=(--config "$model" --allow-cpu --batches 1,4 --context 32 --steps 2 --max-num-batched-tokens 64
         --num-prompts 4 --input-len 16 --output-len 4)
    lat=(--input-len 16 --output-len 4 --num-iters-warmup 1 --num-iters 1)
    thr=(--input-len 16 --output-len 4 --num-prompts 8)
    # interpret-mode Mosaic GPU attention on CPU would take hours at these sizes: the reference path
    mosaic=reference
  else
    e2e=(--config "$model" --batches 1,32,256 --num-prompts 128 --output-len 64)
    lat=(--input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3)
    thr=(--input-len 512 --output-len 128 --num-prompts 512)   # max_num_seqs 256: saturation
    mosaic=mosaic
  fi
  stage e2e 130 $py benchmarks/bench_gpu_e2e.py --attention-backend "$mosaic" "${e2e[@]}"
  stage e2e_fp8 120 $py benchmarks/bench_gpu_e2e.py --attention-backend "$mosaic" --quantization fp8 "${e2e[@]}"
  bench() {  # bench QUANT...: `jaxserve bench` latency at batch 1, then throughput
    $py -m jaxserve.server.cli.main bench latency --model "$model" --load-format dummy "$@" \
      --batch-size 1 "${lat[@]}" && \
    $py -m jaxserve.server.cli.main bench throughput --model "$model" --load-format dummy "$@" "${thr[@]}"
  }
  # `timeout` runs programs, not shell functions: the function and its arrays go in a bash -c
  with_bench="$(declare -f bench); $(declare -p lat thr); py=$py; model=$model; bench"
  stage bench_bf16 100 bash -c "$with_bench"
  stage bench_fp8 100 bash -c "$with_bench --quantization fp8"
  stage e2e_triton 80 $py benchmarks/bench_gpu_e2e.py --attention-backend pallas "${e2e[@]}"
fi

{
  echo
  echo "## GPU suite part $part, $(date -u +%F), $($py -c 'import jax; print(jax.devices()[0].device_kind)' 2>&1 | tail -1)"
  echo
  echo "$($py -c 'import sys, jax, jaxlib; print(f"Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")' 2>&1 | tail -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
  echo "Command: \`${DRY_RUN:+DRY_RUN=1 }PART=$part bash benchmarks/gpu_suite.sh\`"
  echo
  cat "$out/stages.md"
  echo
  if [ "$part" = 1 ]; then
    echo "GPU tests: $(grep -E ' in [0-9.]+s' "$out/gpu_tests.log" | tail -1)"
    echo
    echo "### Paged attention kernels (decode)"
    echo
    grep -E '^(device:|\|)' "$out/kernels.log" 2>/dev/null
    echo
    echo "### FP8 matmul"
    echo
    grep -E '^(device:|\||###)' "$out/fp8.log" 2>/dev/null
    echo
    echo "### int4 matmul (W4A16)"
    echo
    grep -E '^(rows|[ 0-9]+ \||NVIDIA|cuda)' "$out/int4.log" 2>/dev/null
  else
    for s in e2e e2e_fp8 e2e_triton; do
      sed -n '/^### End to end/,$p' "$out/$s.log" 2>/dev/null
      echo
    done
    for s in bench_bf16 bench_fp8; do
      echo "### \`jaxserve bench\` ($s): latency at batch 1, throughput at saturation"
      echo
      grep -E '^(Throughput|Total num|Avg latency|[0-9.]+% percentile latency)' "$out/$s.log" 2>/dev/null
      grep -i -m 2 'attention' "$out/$s.log" 2>/dev/null | cut -c1-200 | sed 's/^/    /'
      echo
    done
  fi
} | tee "$out/results_block.md"
