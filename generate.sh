#!/usr/bin/env bash
# The main job. Until the dataset generator lands (issue 4), it runs one single point, benzene
# B3LYP/STO-3G in float32, and checks it against PySCF float64. Arguments go to `pyscf-ipu run`,
# e.g. ./generate.sh --mol water --xc pbe --json
set -euo pipefail
cd "$(dirname "$0")"
source tools/venv.sh
if [ $# -eq 0 ]; then set -- --mol benzene --check; fi
exec "$PY" -m pyscf_ipu.cli run "$@"
