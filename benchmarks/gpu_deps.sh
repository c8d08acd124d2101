#!/usr/bin/env bash
# Pack PySCF (with pyscf-dispersion), RDKit and geomeTRIC for a GPU machine without them or the
# network: their CPython 3.12 x86-64 wheels, unpacked into one folder and trimmed, as one .tar.xz
# (about 53 MB) that travels with the working tree.
#   benchmarks/gpu_deps.sh [ARCHIVE]          default: .gpu/deps.tar.xz (ignored by git)
# There, in the repository's root, benchmarks/gpu_call.sh unpacks it and runs benchmarks/gpu.py; or by hand:
#   mkdir -p /tmp/site && tar -xJf .gpu/deps.tar.xz -C /tmp/site
#   PYTHONPATH=/tmp/site:. python3 benchmarks/gpu.py --budget 480 --json gpu.json
# The versions are this environment's own, so that both machines label with the same code. Trimmed:
# pyscf/pbc (periodic systems; its library libpbc.so stays, pyscf's DFT library links it), pyscf's
# bundled xcfun with its interface (lib/deps/lib64 and lib/libxcfun_itrf.so; libxc serves every
# functional here, and PySCF skips xcfun when its interface is missing, where a bare interface
# would fail its import) and rdkit/Contrib.
set -euo pipefail
cd "$(dirname "$0")/.."
archive="${1:-.gpu/deps.tar.xz}"
python="${PY:-.venv/bin/python}"
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source benchmarks/cp312_wheels.sh
cp312_wheels "$work/wheels" "pyscf==$(version pyscf)" "rdkit==$(version rdkit)" \
    "pyscf-dispersion==$(version pyscf-dispersion)"
# geomeTRIC is pure Python and published as source only: built into a wheel here
"$python" -m pip wheel --quiet --no-deps -w "$work/wheels" "geometric==$(version geometric)"
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
    "$python" -m zipfile -e "$wheel" "$work/site"
done
find "$work/site/pyscf/pbc" -mindepth 1 -delete
rmdir "$work/site/pyscf/pbc"
rm -rf "$work/site/pyscf/lib/deps/lib64" "$work/site/pyscf/lib/libxcfun_itrf.so" "$work/site/rdkit/Contrib"
mkdir -p "$(dirname "$archive")"
tar -cJf "$archive" -C "$work/site" .
echo "$archive: $(du -h "$archive" | cut -f1) (pyscf $(version pyscf), pyscf-dispersion" \
    "$(version pyscf-dispersion), rdkit $(version rdkit), geometric $(version geometric), cp312)"
