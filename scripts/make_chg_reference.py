"""Regenerate ``tests/references/chg_psi4.json``: Psi4's ``-CHG`` dispersion (ωB97X-D's own correction)
energies and gradients, the independent reference of :class:`pyscf_ipu.dispersion.ChaiHeadGordon`.

PySCF has no such correction, and no PyPI package has it; Psi4 does, and Debian ships it::

    apt-get install psi4
    python scripts/make_chg_reference.py            # with this package's environment

This process builds the geometries (each element H to Xe beside a hydrogen at two distances, which
pin both its C_6 and its radius; paracetamol; an RDKit conformer of diazepam, 20 heavy atoms) and
hands them to Debian's Python, which runs Psi4's ``EmpiricalDispersion`` on each. The file keeps the
geometries, so the test needs neither Psi4 nor RDKit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "references" / "chg_psi4.json"
PSI4_PYTHON = "/usr/bin/python3"
PSI4_PATH = "/usr/lib/x86_64-linux-gnu"  # where Debian's psi4 package puts its module
DIATOMIC_DISTANCES = (4.0, 8.0)  # Bohr: the damping decides the first, C_6 alone the second

# run by Debian's Python: JSON geometries on stdin, Psi4's energies and gradients on stdout
PSI4_WORKER = r"""
import json, sys
import psi4
from psi4.driver.procrouting.empirical_dispersion import EmpiricalDispersion

psi4.core.be_quiet()
dispersion = EmpiricalDispersion(name_hint="wb97x-d")
assert dispersion.dashlevel == "chg", dispersion.dashlevel
out = {"psi4": psi4.__version__, "dashlevel": dispersion.dashlevel, "params": dispersion.dashparams, "molecules": []}
for entry in json.load(sys.stdin):
    electrons = sum(entry["atomic_numbers"])
    rows = [f"{z} {x!r} {y!r} {w!r}" for z, (x, y, w) in zip(entry["atomic_numbers"], entry["positions"])]
    text = "\n".join([f"0 {1 + electrons % 2}", *rows, "units bohr", "no_com", "no_reorient", "symmetry c1"])
    molecule = psi4.geometry(text, name="m")
    entry["energy"] = dispersion.compute_energy(molecule)
    entry["gradient"] = dispersion.compute_gradient(molecule).np.tolist()
    out["molecules"].append(entry)
json.dump(out, sys.stdout)
"""


def geometries() -> list[dict]:
    """The reference's molecules: name, atomic numbers and positions (Bohr)."""
    from pyscf_ipu.molecule import from_name
    from qm1b.conformers import embed_conformers

    entries = [{"name": f"Z{z}-H at {r}", "atomic_numbers": [z, 1], "positions": [[0.0, 0.0, 0.0], [0.0, 0.0, r]]}
               for z in range(1, 55) for r in DIATOMIC_DISTANCES]  # fmt: skip
    diazepam = embed_conformers("CN1C(=O)CN=C(c2ccccc2)c2cc(Cl)ccc21", 1, seed=7, molecule_id=0)[0]
    for name, molecule in [("paracetamol", from_name("paracetamol")), ("diazepam", diazepam)]:
        entries.append({"name": name, "atomic_numbers": np.asarray(molecule.atomic_numbers).tolist(),
                        "positions": np.asarray(molecule.positions, np.float64).tolist()})  # fmt: skip
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not Path(PSI4_PATH, "psi4").is_dir():
        print(f"no Psi4 under {PSI4_PATH}: apt-get install psi4", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": PSI4_PATH}
    with tempfile.TemporaryDirectory() as scratch:  # Psi4 leaves its timer.dat where it runs
        done = subprocess.run([PSI4_PYTHON, "-c", PSI4_WORKER], input=json.dumps(geometries()), capture_output=True,
                              text=True, env=env, cwd=scratch, check=False)  # fmt: skip
    if done.returncode != 0:
        print(f"Psi4 failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json.loads(done.stdout)) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
