#!/usr/bin/env bash
# Download, on a machine with network, the wheels benchmarks/gpu_suite.sh installs on the GPU
# image (which has no package index): benchmarks/gpu_wheels.txt -> .whl/ (git-ignored), for
# CPython 3.12 on x86-64 manylinux, no dependencies pulled (the list names every one needed).
#
#   bash benchmarks/gpu_wheels.sh        # then run the suite with .whl carried to the GPU machine
#
# Checks the result: one wheel per listed name, all under the 64 MiB the device tool carries.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
mkdir -p .whl
mapfile -t reqs < <(grep -vE '^\s*(#|$)' benchmarks/gpu_wheels.txt)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${reqs[@]}"
missing=()
for r in "${reqs[@]}"; do
  name=${r%%==*}; version=${r#*==}
  stem=$(echo "$name" | tr '-' '_')
  ls .whl/ | grep -qi "^${stem}-${version}-" || missing+=("$r")
done
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "wheels in .whl: $(ls .whl | wc -l), $((total / 1024 / 1024)) MiB"
if [ "${#missing[@]}" -gt 0 ]; then
  echo "missing: ${missing[*]}" >&2
  exit 1
fi
[ "$total" -lt $((48 * 1024 * 1024)) ] || { echo ".whl over 48 MiB: the working tree must stay under 64 MiB" >&2; exit 1; }
