"""Real molecules from QM9, read offline from the PyPI package ``qm9pack``.

``qm9pack`` ships QM9 (130,831 molecules) as CSV files. The package itself imports ``pkg_resources``,
which current setuptools no longer has, so we find its data folder without importing it and read
the CSV files directly.
Positions are in Angstrom there; HOMO and LUMO in Hartree, at QM9's B3LYP/6-31G(2df,p) (the
``qm9`` preset's level; ``benchmarks/qm9_published.py`` compares them with ours).
"""

from __future__ import annotations

import csv
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .geometries import qm9_frame
from .molecule import Molecule

_PARTS = ("qm9_part1.csv", "qm9_part2.csv", "qm9_part3.csv")


@dataclass(frozen=True, eq=False)
class QM9Record:
    index: int  # QM9's own 1-based index
    smiles: str
    molecule: Molecule
    homo_hartree: float
    lumo_hartree: float

    @property
    def heavy_atoms(self) -> int:
        return int(np.count_nonzero(self.molecule.atomic_numbers > 1))


def _data_dir() -> Path:
    """qm9pack's CSV folder, found without importing qm9pack: its ``__init__`` imports
    ``pkg_resources``, which setuptools >= 81 (pulled in by torch, for one) no longer has."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("QM9 needs the package qm9pack: pip install qm9pack")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def rows() -> Iterator[dict]:
    """Every row of qm9pack's CSV files, in index order."""
    data = _data_dir()
    csv.field_size_limit(1 << 24)
    for part in _PARTS:
        with (data / part).open(newline="") as handle:
            yield from csv.DictReader(handle)


def row_heavy_atoms(row: dict) -> int:
    """The heavy atoms of a qm9pack row, read from its element list alone (no geometry parsed)."""
    return sum(symbol != "H" for symbol in json.loads(row["Elements"].replace("'", '"')))


def _record(row: dict) -> QM9Record:
    molecule = qm9_frame(row).molecule(name=f"qm9_{int(row['Index']):06d}")
    return QM9Record(int(row["Index"]), row["SMILES"], molecule, float(row["HOMO_au"]), float(row["LUMO_au"]))


def iter_qm9(heavy_atoms: int | None = None, start: int = 1) -> Iterator[QM9Record]:
    """QM9 records in index order from ``start``, optionally only those with ``heavy_atoms`` heavy atoms."""
    for row in rows():
        if int(row["Index"]) < start:
            continue
        if heavy_atoms is not None and row_heavy_atoms(row) != heavy_atoms:
            continue
        yield _record(row)


def qm9_molecules(indices: list[int]) -> list[QM9Record]:
    """The records with the given QM9 indices, in the order asked."""
    wanted = set(indices)
    found: dict[int, QM9Record] = {}
    for row in rows():
        index = int(row["Index"])
        if index in wanted:
            found[index] = _record(row)
            if len(found) == len(wanted):
                break
    missing = wanted - found.keys()
    if missing:
        raise KeyError(f"QM9 indices not found: {sorted(missing)}")
    return [found[i] for i in indices]
