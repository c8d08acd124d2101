"""``qm1b validate``: recompute a random sample of records with PySCF float64, report the errors, and
name the converged records further from PySCF than a tolerance."""

from __future__ import annotations

import dataclasses

import numpy as np

from pyscf_ipu.molecule import Molecule
from pyscf_ipu.resolution import resolve
from pyscf_ipu.reference import pyscf_reference
from pyscf_ipu.units import HARTREE_TO_MEV

from .settings import dft_config
from .store import open_dataset

QUANTITIES = ("energy", "homo", "lumo", "y")
TOLERANCE_MEV = 2.0  # the float32 label tolerance (docs/science.md)


def validate(directory, sample: int, seed: int = 0, tolerance_mev: float = TOLERANCE_MEV) -> dict:
    """Errors (meV) of ``sample`` random records against PySCF float64 with the dataset's settings;
    ``outside``: the converged ones with a label more than ``tolerance_mev`` from PySCF's."""
    if not tolerance_mev > 0:
        raise ValueError(f"--tolerance must be a positive number of meV, got {tolerance_mev}")
    dataset = open_dataset(directory)
    config = dft_config(dataset.attrs["settings"])
    method = resolve(config)
    records = list(dataset.records())
    if not records:
        raise ValueError(f"{directory} has no records to validate")
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(records), size=min(sample, len(records)), replace=False).tolist())
    rows = []
    for k in chosen:
        rec = records[k]
        molecule = Molecule(np.asarray(rec["z"], int), np.asarray(rec["pos"], float))
        ref = pyscf_reference(molecule, method)
        ref_mev = {"energy": ref.energy, "homo": ref.homo, "lumo": ref.lumo, "y": ref.gap}
        errors = {q: float(rec[q]) * 1000.0 - ref_mev[q] * HARTREE_TO_MEV for q in QUANTITIES}
        rows.append({"index": k, "molecule_id": int(rec["molecule_id"]), "conformer_id": int(rec["conformer_id"]),
                     "converged": bool(rec["converged"]), "errors_mev": errors})  # fmt: skip
    converged = [r for r in rows if r["converged"]]
    stats = {}
    for q in QUANTITIES:
        err = np.abs([r["errors_mev"][q] for r in rows])
        stats[q] = {"max": float(err.max()), "mean": float(err.mean()), "p95": float(np.percentile(err, 95))}
    outside = [r for r in converged if any(abs(v) > tolerance_mev for v in r["errors_mev"].values())]
    return {
        "sampled": len(rows),
        "converged": len(converged),
        "tolerance_mev": tolerance_mev,
        "converged_within_tolerance": len(converged) - len(outside),
        "outside": outside,
        "abs_error_mev": stats,
        "records": rows,
        "settings": dataclasses.asdict(config),
    }
