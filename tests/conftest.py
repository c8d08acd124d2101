"""Shared fixtures: the persistent compilation cache, test molecules and cached PySCF references.

PySCF float64 references are computed in the test run (tightly converged) and cached on disk,
keyed by the geometry and the settings, so a second run does not repeat them.
Set PYSCF_IPU_CACHE to move the cache (default ~/.cache/pyscf-ipu).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings

import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig, default_cache_dir, enable_compilation_cache
from pyscf_ipu.molecule import Molecule, from_name
from pyscf_ipu.reference import Reference, pyscf_reference

# Five 9-heavy-atom QM9 molecules: a pyridine oxime, a fluorinated one, an aromatic bicycle, a cage
# with a nitrile and an alkyne, and an open chain with three oxygens.
QM9_NINE_HEAVY = [21989, 22032, 24320, 33818, 53938]


def pytest_configure(config):
    enable_compilation_cache()
    warnings.filterwarnings("ignore", category=UserWarning, module="pyscf")


@pytest.fixture(scope="session")
def qm9_nine_heavy() -> dict[int, Molecule]:
    from pyscf_ipu.qm9 import qm9_molecules

    return {rec.index: rec.molecule for rec in qm9_molecules(QM9_NINE_HEAVY)}


def molecule_by_name(name: str, qm9: dict[int, Molecule] | None = None) -> Molecule:
    """'water', 'benzene', ... or 'qm9:21989'."""
    if name.startswith("qm9:"):
        return qm9[int(name[4:])]
    return from_name(name)


def _key(molecule: Molecule, config: RKSConfig) -> str:
    payload = {
        "z": molecule.atomic_numbers.tolist(),
        "pos": np.round(molecule.positions, 10).tolist(),
        "charge": molecule.charge,
        "basis": config.basis,
        "xc": config.xc,
        "grid_level": config.grid_level,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


@pytest.fixture(scope="session")
def reference():
    """reference(molecule, config) -> tightly converged PySCF float64 Reference, cached on disk."""
    folder = default_cache_dir() / "references"
    folder.mkdir(parents=True, exist_ok=True)

    def get(molecule: Molecule, config: RKSConfig) -> Reference:
        path = folder / f"{_key(molecule, config)}.json"
        if path.exists():
            return Reference(**json.loads(path.read_text()))
        ref = pyscf_reference(molecule, config)
        assert ref.converged, f"PySCF did not converge for {molecule.name} {config}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(ref)))
        tmp.replace(path)  # atomic: a killed run never leaves half a file
        return ref

    return get
