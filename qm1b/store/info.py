"""The summary of a dataset that ``qm1b info`` prints."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np

from .reader import open_dataset


def _stats(x: np.ndarray) -> dict | None:
    if not len(x):
        return None
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "max": float(x.max())}


def _throughput(seconds: np.ndarray) -> dict | None:
    """Conformers per hour of one generator process, from the per-record wall times.

    Shards run in parallel add their hours, so this is the rate per worker, not of the whole run.
    """
    total = float(np.sum(seconds, dtype=np.float64))
    if not len(seconds) or total <= 0:
        return None
    return {
        "conformers_per_hour_per_worker": 3600.0 * len(seconds) / total,
        "seconds_per_conformer": total / len(seconds),
        "worker_hours": total / 3600.0,
    }


def failure_kind(reason: str) -> str:
    """What a failure's reason says less its particulars, for counting: the step it happened at and
    what follows a second colon go ("relaxation: atoms collided: C1 and H5 0.31 Angstrom apart" and
    "relaxation: SCF not converged at step 3" count as "relaxation: atoms collided" and
    "relaxation: SCF not converged")."""
    return ": ".join(re.sub(r" at step \d+", "", reason).split(": ")[:2])


def info(directory: Path | str) -> dict:
    """Counts, convergence, failure reasons and label statistics of a dataset (JSON-serializable)."""
    with open_dataset(directory) as ds:
        names = ("energy", "homo", "lumo", "y", "std", "converged", "iterations", "seconds", "molecule_id", "natoms")
        col = {k: ds.column(k) for k in names}
        failures = ds.failures()
        n = len(ds)
        labels = {"energy_per_atom": _stats(col["energy"] / col["natoms"])}
        labels.update({k: _stats(col[k]) for k in ("homo", "lumo", "y", "std")})
        return {
            "records": n,
            "failures": len(failures),
            "molecules": int(len(np.unique(col["molecule_id"]))),
            "failed_molecules": len({x.molecule_id for x in failures if x.conformer_id == -1}),
            "shards": len(ds.shards),
            "num_shards": ds.num_shards,
            "unmerged_parts": ds.unmerged_parts,
            "convergence_rate": float(col["converged"].mean()) if n else None,
            "failure_reasons": dict(Counter(failure_kind(x.reason) for x in failures).most_common()),
            "labels": labels,
            "iterations": {
                "mean": float(col["iterations"].mean()) if n else None,
                "max": int(col["iterations"].max()) if n else None,
            },
            "throughput": _throughput(col["seconds"]),
            "settings": ds.attrs["settings"],
            "versions": ds.attrs["versions"],
            "schema_version": ds.attrs["schema_version"],
        }
