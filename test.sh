#!/usr/bin/env bash
# Create or refresh .venv, install pyscf-ipu with its test extra, and run the test suite.
#   ./test.sh              the suite CI runs (bound by compiling: tens of minutes on 2 cores with empty caches, less warm)
#   ./test.sh --slow       also the full acceptance matrix against PySCF (tens of minutes)
#   ./test.sh -k scf -x    any other arguments go to pytest
# The tests run in pytest-xdist workers, one per core (at most 4, and at most one per 6 GiB of
# memory), each test file in one worker (its module fixtures computed once), each with its share of
# the cores for OpenMP; `-n 0` runs them in this process (needed for --pdb).
set -euo pipefail
cd "$(dirname "$0")"
threads="${OMP_NUM_THREADS:-}"  # the caller's own, if set (tools/venv.sh sets a default)
PYSCF_IPU_EXTRAS=test source tools/venv.sh
read -r workers per_worker < <("$PY" -c '
import os
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
workers = max(1, min(4, cores, int(gib // 6)))  # at most 4, one per core, one per 6 GiB of memory
print(workers, max(1, cores // workers))
')
# each worker's OpenMP (PySCF) on its share of the cores: threads of two workers on one core wait
# for each other at every parallel region
export OMP_NUM_THREADS="${threads:-$per_worker}"
args=(-n "$workers" --dist loadfile)
for a in "$@"; do
    if [ "$a" = "--slow" ]; then args+=(-m "slow or not slow"); else args+=("$a"); fi
done
exec "$PY" -m pytest "${args[@]}"
