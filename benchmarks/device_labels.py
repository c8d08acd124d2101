"""The generator's labels on this machine's default JAX device (a GPU where there is one) against
PySCF float64, with the device named and the seconds per conformer.

    python benchmarks/device_labels.py FILE.xyz[:BASIS[:JK]] ... [--batch-size 8]

Each argument is a multi-frame XYZ file (one molecule's conformers, or several molecules' frames),
optionally with the basis (default sto-3g) and the J-K backend (default: the generator's). For each,
``qm1b generate --geometries`` runs twice in new processes on one empty program directory (cold,
then restarted), at B3LYP5 and grid level 0, otherwise the defaults; then PySCF labels every frame
from scratch, density fitted in the same fitting basis where the backend is (what our labels are
compared with), and the largest label differences are printed in meV with the converged count.

It needs no RDKit (the conformers come from the files), so it runs where only JAX, PySCF and h5py
are installed. Threads: PySCF's are whatever ``OMP_NUM_THREADS`` says.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

from cost_growth import XC, largest_difference, ours, pyscf_timed
from throughput import LABELS

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.reference import pyscf_method
from pyscf_ipu.geometries import read_frames
from pyscf_ipu.memory import default_budget
from pyscf_ipu.programs import device_description
from qm1b.store import open_dataset


def check(spec: str, batch: int, work: Path) -> dict:
    """One file's row: seconds per conformer (cold, restarted), convergence and label differences."""
    path, basis, jk = (spec.split(":") + [""] * 2)[:3]
    basis, jk = basis or "sto-3g", jk or RKSConfig().jk
    frames = read_frames(path)
    tag = f"{Path(path).stem}-{basis.replace('*', 's')}-{jk}"
    cache = work / f"cache-{tag}"
    budget = default_budget()
    cold, _ = ours(Path(path), work / f"cold-{tag}", cache, basis, 0, jk, batch, budget)
    restarted, peak = ours(Path(path), work / f"restarted-{tag}", cache, basis, 0, jk, batch, budget)
    with open_dataset(work / f"restarted-{tag}") as ds:
        columns = ds.arrays().columns
        order = np.lexsort((columns["conformer_id"], columns["molecule_id"]))  # the file's order
        labels = [{q: float(columns[q][i]) for q in LABELS} for i in order]
        converged = int(np.sum(columns["converged"]))
    config = RKSConfig(basis=basis, xc=XC, grid_level=0, jk=jk)
    seconds, refs = zip(*(pyscf_timed(f.molecule(), config) for f in frames))  # density fitted where ours is
    n = len(frames)
    return {"file": Path(path).stem, "basis": basis, "jk": jk, "conformers": n, "written": len(labels), "converged": converged,
            "cold": cold / n, "restarted": restarted / n, "pyscf": float(np.mean(seconds)), "peak_gb": peak / 1e9,
            "max_mev": largest_difference(labels, list(refs)),
            "by_label_mev": {q: float(np.max([1000 * abs(a[q] - b[q]) for a, b in zip(labels, refs)])) for q in LABELS},
            "pyscf_method": type(pyscf_method(frames[0].molecule(), resolve(config))).__name__}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE.xyz[:BASIS[:JK]]")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", default="", metavar="FILE", help="also write the rows here")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    print(f"device: {device_description()}; {XC}, grid level 0, float32 (full precision)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="device-labels-") as work:
        for spec in args.files:
            row = check(spec, args.batch_size, Path(work))
            rows.append(row)
            print(f"{row['file']:14s} {row['basis']:8s} {row['jk']:4s} {row['written']:3d}/{row['conformers']:3d} written, "
                  f"{row['converged']:3d} converged | cold {row['cold']:6.2f} s, restarted {row['restarted']:6.3f} s, "
                  f"PySCF {row['pyscf']:6.2f} s per conformer | largest label difference {row['max_mev']:.3f} meV "
                  f"({', '.join(f'{k} {v:.3f}' for k, v in row['by_label_mev'].items())})", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_description(), "rows": rows}, indent=1))
    bad = [r["file"] for r in rows if r["max_mev"] > 2.0 or r["converged"] < 0.99 * r["conformers"]]
    print("labels within 2 meV and >= 99% converged everywhere" if not bad else f"FAILED: {', '.join(bad)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
