#!/usr/bin/env bash
# Pack GPU4PySCF for a GPU machine without the network, in parts that each fit one call's carry:
# its two CPython 3.12 x86-64 wheels for CUDA 13 (gpu4pyscf-cuda13x and gpu4pyscf-libxc-cuda13x,
# together larger than the 64 MiB a call may carry) as one tar, cut into parts of at most 60 MB.
#   benchmarks/gpu4pyscf_deps.sh [DIR]          default: .gpu/gpu4pyscf (ignored by git)
# There, one call per part made back to back (a machine keeps its files while it stays warm), each
# carrying its part and appending it:   cat .gpu/gpu4pyscf/part-XX >> /tmp/gpu4pyscf.tar
# and in the last call, before benchmarks/gpu.py --phases gpu4pyscf:
#   mkdir -p /tmp/site && tar -xf /tmp/gpu4pyscf.tar -C /tmp/site && (cd /tmp/site && for w in *.whl; do
#   python3 -m zipfile -e "$w" .; done)
# then PYTHONPATH=/tmp/site:... as for benchmarks/gpu_deps.sh (PySCF comes from that archive).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu/gpu4pyscf}"
python="${PY:-.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source benchmarks/cp312_wheels.sh
cp312_wheels "$work/wheels" "gpu4pyscf-cuda13x==${GPU4PYSCF_VERSION:-1.9.0}" "gpu4pyscf-libxc-cuda13x==${LIBXC_VERSION:-0.9.0}"
mkdir -p "$out"
rm -f "$out"/part-*
tar -cf "$work/gpu4pyscf.tar" -C "$work/wheels" .
split -b 60M -d "$work/gpu4pyscf.tar" "$out/part-"
echo "$out: $(ls "$out" | wc -l) parts, $(du -ch "$out"/part-* | tail -1 | cut -f1) ($(ls "$work/wheels" | tr '\n' ' '))"
