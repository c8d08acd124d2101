#!/usr/bin/env bash
# The main job: generate a QM1B-style dataset (SMILES -> RDKit conformers -> B3LYP/STO-3G float32
# DFT -> HDF5 shards). It creates/refreshes .venv on first use.
#   ./generate.sh                      5 molecules x 8 conformers of the built-in sample into
#                                      data/generated/ (resumable: run it again to continue)
#   ./generate.sh --smiles gdb11.smi --out DIR --conformers 100 --shard 3/16   any `qm1b generate` options
set -euo pipefail
cd "$(dirname "$0")"
PYSCF_IPU_EXTRAS="${PYSCF_IPU_EXTRAS:-generator}" source tools/venv.sh
if [ $# -eq 0 ]; then
    set -- --out data/generated --limit 5 --conformers 8 --resume
fi
"$PY" -m qm1b.cli generate "$@"
