#!/usr/bin/env bash
# One call on a lent GPU machine: benchmarks/gpu.py once per argument, one after another, each inside
# its own budget, with the archive of benchmarks/gpu_deps.sh (carried as .gpu) on PYTHONPATH where
# python3 lacks PySCF, RDKit or geomeTRIC.
#   bash benchmarks/gpu_call.sh PHASES:SECONDS [PHASES:SECONDS ...]
#   e.g. bash benchmarks/gpu_call.sh sto3g,programs,pyscf,labels:280 variants:150 forces:
# Phases that read another's run (programs, pyscf, labels and variants read sto3g's) go in its argument.
# An argument's SECONDS left out: what is left of TOTAL (default 585 s, for a 600 s call). Each run's
# console output and figures go to $OUT/N.log and $OUT/N.json (N counts the arguments from 1), where
# the device tool returns them; the device's settings are never changed here.
set -u
export PYTHONUNBUFFERED=1
start=$(date +%s)
out="${OUT:-.gpu/out}"
mkdir -p "$out"
if ! python3 -c "import pyscf, rdkit, geometric" 2>/dev/null; then  # a machine without them: the archive
    mkdir -p /tmp/site
    [ -d /tmp/site/pyscf ] || tar -xJf .gpu/deps.tar.xz -C /tmp/site || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
n=0
for run in "$@"; do
    n=$((n + 1))
    phases="${run%%:*}" seconds="${run#*:}"
    [ -n "$seconds" ] && [ "$seconds" != "$run" ] || seconds=$(( ${TOTAL:-585} - ($(date +%s) - start) ))
    python3 benchmarks/gpu.py --phases "$phases" --budget "$seconds" --json "$out/$n.json" 2>&1 | tee "$out/$n.log"
    echo "run $n ($phases) ended at $(( $(date +%s) - start )) s"
done
