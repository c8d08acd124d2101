# Sourced by test.sh and generate.sh: create or refresh the project's virtual environment and
# install the package (with the extras named in $PYSCF_IPU_EXTRAS). Sets $PY to its python.
# PYSCF_IPU_VENV moves the environment (default: .venv beside this repository's files).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PYSCF_IPU_VENV:-$repo/.venv}"
if ! command -v python3 >/dev/null; then
    echo "error: python3 (>= 3.10) is needed" >&2
    exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment $venv" >&2
    python3 -m venv "$venv"
fi
PY="$venv/bin/python"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "error: $venv uses $("$PY" --version); pyscf-ipu needs Python >= 3.10" >&2
    exit 1
}
stamp="$venv/.installed-$(cat "$repo/pyproject.toml" | sha1sum | cut -c1-12)-${PYSCF_IPU_EXTRAS:-none}"
if [ ! -e "$stamp" ]; then
    echo "installing pyscf-ipu[${PYSCF_IPU_EXTRAS:-}] into $venv" >&2
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e "$repo${PYSCF_IPU_EXTRAS:+[$PYSCF_IPU_EXTRAS]}"
    touch "$stamp"
fi
# PySCF is about twice as fast with one BLAS thread and two OpenMP threads on this 2-core machine.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
