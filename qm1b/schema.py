"""Column definitions of a qm1b dataset and the in-memory batch that the generator commits.

A record is one conformer of one molecule with its DFT labels.  The QM1B columns (units: energies
in eV, positions in Bohr) are

    smile   str      the SMILES of the molecule
    atoms   str      element symbols in atom order, concatenated ("COHH")
    z       int8     (natoms,) atomic numbers
    pos     float32  (natoms, 3) positions, Bohr
    energy  float64  total energy, eV
    homo    float64  HOMO energy, eV
    lumo    float64  LUMO energy, eV
    y       float64  HOMO-LUMO gap = lumo - homo, eV
    N       int32    number of atomic orbitals
    std     float64  standard deviation of the energy over the last SCF iterations, eV

With ``--forces`` the generator adds ``forces`` float32 (natoms, 3), eV/Bohr, = -dE/dR (the QM1B
release had none). qm1b adds the bookkeeping columns ``converged`` (bool), ``iterations`` (int16), ``seconds``
(float32: the record's share of the generator's wall time for its batch),
``molecule_id`` (int64) and ``conformer_id`` (int32).  ``(molecule_id, conformer_id)`` identifies a
record; a :class:`Failure` with ``conformer_id == -1`` stands for a whole molecule.

Batches are ragged: per-atom arrays are stored flat, in record order, with ``natoms`` giving each
record's share, exactly as in the HDF5 files (see :mod:`qm1b.store`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import h5py
import numpy as np

from pyscf_ipu.units import HARTREE_TO_EV

if TYPE_CHECKING:
    from pyscf_ipu.molecule import Molecule
    from pyscf_ipu.results import SCFResult

SCHEMA_VERSION = 1

# Exported to Parquet, in this order (the QM1B release's columns).
QM1B_COLUMNS = ("smile", "atoms", "z", "pos", "energy", "homo", "lumo", "y", "N", "std")

STRING_DTYPE = h5py.string_dtype()  # variable-length UTF-8; in memory: object arrays of str

# Every per-record scalar column and its dtype, in storage order.
SCALAR_COLUMNS: dict[str, np.dtype] = {
    "smile": STRING_DTYPE,
    "atoms": STRING_DTYPE,
    "energy": np.dtype(np.float64),
    "homo": np.dtype(np.float64),
    "lumo": np.dtype(np.float64),
    "y": np.dtype(np.float64),
    "N": np.dtype(np.int32),
    "std": np.dtype(np.float64),
    "converged": np.dtype(np.bool_),
    "iterations": np.dtype(np.int16),
    "seconds": np.dtype(np.float32),
    "molecule_id": np.dtype(np.int64),
    "conformer_id": np.dtype(np.int32),
}

# Optional per-record columns, present in a dataset only where its settings ask for them:
# optimizer_steps (generate --relax dft): the geometry optimiser's gradient evaluations, the start's
# included (``iterations`` stays the last SCF's); step (the trajectory frames of --trajectory): the
# frame's place in its conformer's optimisation, 0 the start.
OPTIONAL_COLUMNS: dict[str, np.dtype] = {"optimizer_steps": np.dtype(np.int16), "step": np.dtype(np.int16)}

# Per-atom columns: z (natoms,) int8, pos (natoms, 3) float32.
ATOM_COLUMNS: dict[str, np.dtype] = {"z": np.dtype(np.int8), "pos": np.dtype(np.float32)}
# Optional per-atom column (generate --forces): forces (natoms, 3) float32, eV/Bohr, = -dE/dR.
FORCES_DTYPE = np.dtype(np.float32)

STRING_COLUMNS = tuple(k for k, v in SCALAR_COLUMNS.items() if h5py.check_string_dtype(v))
LABEL_COLUMNS = ("energy", "homo", "lumo", "y", "std")  # must be finite
GAP_TOLERANCE = 1e-4  # eV: |y - (lumo - homo)| above this is a generator bug


@dataclass(frozen=True)
class Failure:
    """An input that produced no record, and why."""

    input: str  # the SMILES (or other input) that failed
    reason: str  # e.g. "bad SMILES", "embedding failed", "element Xe not in basis sto-3g"
    molecule_id: int
    conformer_id: int = -1  # -1: the whole molecule failed

    @property
    def key(self) -> tuple[int, int]:
        return (int(self.molecule_id), int(self.conformer_id))


@dataclass(frozen=True)
class RecordBatch:
    """n records, stored ragged: per-atom arrays flat plus the number of atoms of each record."""

    columns: dict[str, np.ndarray]  # each SCALAR_COLUMNS name -> (n,) array
    natoms: np.ndarray  # (n,) int
    z: np.ndarray  # (sum natoms,) int8
    pos: np.ndarray  # (sum natoms, 3) float32, Bohr
    forces: np.ndarray | None = None  # (sum natoms, 3) float32, eV/Bohr (= -dE/dR); only with --forces

    def __len__(self) -> int:
        return len(self.natoms)

    @classmethod
    def empty(cls) -> RecordBatch:
        columns = {k: np.zeros(0, dtype=v) for k, v in SCALAR_COLUMNS.items()}
        return cls(columns, np.zeros(0, np.int32), np.zeros(0, np.int8), np.zeros((0, 3), np.float32))

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, Iterable],
        natoms: Iterable[int],
        z: Iterable[int],
        pos: Iterable,
        forces: Iterable | None = None,
    ) -> RecordBatch:
        """Build a batch from array-likes, casting each to its schema dtype, then validate it.

        Numeric casts must be 'same_kind' (float64 -> float32 is fine, float -> int is not).
        """
        batch = cls._from_array_likes(columns, natoms, z, pos, forces)
        batch.validate()
        return batch

    @classmethod
    def _from_array_likes(cls, columns: Mapping[str, Iterable], natoms: Iterable[int], z: Iterable[int], pos: Iterable,
                          forces: Iterable | None) -> RecordBatch:  # fmt: skip
        """A batch of array-likes cast to the schema's dtypes ('same_kind'), not yet validated."""
        cast = {}
        for name, value in columns.items():
            dtype = SCALAR_COLUMNS.get(name, OPTIONAL_COLUMNS.get(name))
            cast[name] = _as_strings(value) if name in STRING_COLUMNS else _cast(name, value, dtype)
        return cls(
            cast,
            _cast("natoms", natoms, np.dtype(np.int32)),
            _cast("z", z, ATOM_COLUMNS["z"]),
            _cast("pos", pos, ATOM_COLUMNS["pos"]).reshape(-1, 3),
            None if forces is None else _cast("forces", forces, FORCES_DTYPE).reshape(-1, 3),
        )

    @classmethod
    def from_results(cls, labelled: Sequence[tuple[str, int, int, Molecule, SCFResult]], seconds: float | Sequence[float],
                     gradients: Sequence[np.ndarray] | None = None, optional: Mapping[str, Sequence] | None = None
                     ) -> RecordBatch:  # fmt: skip
        """Records of labelled conformers, each (SMILES, molecule id, conformer id, conformer, result),
        with every energy converted from Hartree to eV; ``seconds`` is shared equally among them (or
        given per record), ``gradients`` (dE/dR, (natoms, 3) Hartree/Bohr each) are stored as forces in
        eV/Bohr, and ``optional`` adds :data:`OPTIONAL_COLUMNS`. Not validated here:
        ``ShardWriter.commit`` validates every batch it writes."""
        smiles, molecule_ids, conformer_ids, molecules, results = zip(*labelled)
        columns = {
            "smile": smiles,
            "atoms": [m.formula for m in molecules],
            "energy": [HARTREE_TO_EV * r.energy for r in results],
            "homo": [HARTREE_TO_EV * r.homo for r in results],
            "lumo": [HARTREE_TO_EV * r.lumo for r in results],
            "y": [HARTREE_TO_EV * r.gap for r in results],
            "N": [r.nao for r in results],
            "std": [r.energy_std_ev for r in results],  # computed in eV by the loop
            "converged": [r.converged for r in results],
            "iterations": [r.iterations for r in results],
            "seconds": [seconds / len(results)] * len(results) if np.isscalar(seconds) else seconds,
            "molecule_id": molecule_ids,
            "conformer_id": conformer_ids,
            **(optional or {}),
        }
        forces = None if gradients is None else -HARTREE_TO_EV * np.concatenate(gradients)
        z = np.concatenate([m.atomic_numbers for m in molecules])
        pos = np.concatenate([m.positions for m in molecules])
        return cls._from_array_likes(columns, [m.natom for m in molecules], z, pos, forces)

    @classmethod
    def concat(cls, batches: Iterable[RecordBatch]) -> RecordBatch:
        batches = list(batches)
        if not batches:
            return cls.empty()
        names = [set(b.columns) for b in batches]
        if any(n != names[0] for n in names):
            raise ValueError("columns: the batches have different optional columns")
        columns = {k: np.concatenate([b.columns[k] for b in batches]) for k in batches[0].columns}
        with_forces = [b.forces is not None for b in batches]
        if any(with_forces) and not all(with_forces):
            raise ValueError("forces: some batches have them and some do not (generated with and without --forces)")
        return cls(
            columns,
            np.concatenate([b.natoms for b in batches]),
            np.concatenate([b.z for b in batches]),
            np.concatenate([b.pos for b in batches]).reshape(-1, 3),
            np.concatenate([b.forces for b in batches]).reshape(-1, 3) if all(with_forces) else None,
        )

    def atom_offsets(self) -> np.ndarray:
        """(n + 1,) int64: record i's atoms are z[off[i]:off[i + 1]]."""
        return np.concatenate([[0], np.cumsum(self.natoms, dtype=np.int64)])

    def take(self, index: np.ndarray) -> RecordBatch:
        """The records at the given (n,) positions, in that order."""
        index = np.asarray(index, dtype=np.int64)
        starts = self.atom_offsets()[index]  # (k,) first atom of each taken record
        lengths = np.asarray(self.natoms, dtype=np.int64)[index]  # (k,)
        new_starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
        # atom j of the output comes from starts[r] + (j - new_starts[r]), r its record
        atom_index = np.arange(lengths.sum()) + np.repeat(starts - new_starts, lengths)
        return RecordBatch(
            {k: v[index] for k, v in self.columns.items()},
            self.natoms[index],
            self.z[atom_index],
            self.pos[atom_index].reshape(-1, 3),
            None if self.forces is None else self.forces[atom_index].reshape(-1, 3),
        )

    @property
    def layout(self) -> frozenset[str]:
        """The optional columns this batch has: of :data:`OPTIONAL_COLUMNS`, and ``forces``."""
        return frozenset([k for k in self.columns if k in OPTIONAL_COLUMNS] + (["forces"] if self.forces is not None else []))

    def keys(self) -> list[tuple[int, int]]:
        """(molecule_id, conformer_id) of every record, in order."""
        mol = self.columns["molecule_id"].tolist()
        conf = self.columns["conformer_id"].tolist()
        return list(zip(mol, conf))

    def validate(self) -> None:
        """Raise ValueError, naming the column, unless the batch is consistent and its labels finite."""
        self._validate_column_names()
        n = self._validate_natoms()
        for name, value in self.columns.items():
            _check_column(name, value, SCALAR_COLUMNS.get(name, OPTIONAL_COLUMNS.get(name)), n)
        self._validate_atoms()
        self._validate_labels()
        self._validate_keys()

    def _validate_column_names(self) -> None:
        missing = [k for k in SCALAR_COLUMNS if k not in self.columns]
        extra = [k for k in self.columns if k not in SCALAR_COLUMNS and k not in OPTIONAL_COLUMNS]
        if missing:
            raise ValueError(f"RecordBatch: missing column(s) {missing}")
        if extra:
            raise ValueError(f"RecordBatch: unknown column(s) {extra}")

    def _validate_natoms(self) -> int:
        natoms = np.asarray(self.natoms)
        if natoms.ndim != 1 or natoms.dtype.kind not in "iu":
            raise ValueError(f"natoms: expected a 1-D integer array, got {natoms.dtype} {natoms.shape}")
        if natoms.size and natoms.min() < 1:
            raise ValueError("natoms: every record needs at least one atom")
        return len(natoms)

    def _validate_atoms(self) -> None:
        m = int(np.sum(self.natoms, dtype=np.int64))
        _check_array("z", self.z, ATOM_COLUMNS["z"], (m,))
        _check_array("pos", self.pos, ATOM_COLUMNS["pos"], (m, 3))
        if m and self.z.min() < 1:
            raise ValueError("z: atomic numbers must be >= 1")
        if not np.all(np.isfinite(self.pos)):
            raise ValueError("pos: positions must be finite")
        if self.forces is not None:
            _check_array("forces", self.forces, FORCES_DTYPE, (m, 3))
            if not np.all(np.isfinite(self.forces)):
                raise ValueError("forces: forces must be finite")

    def _validate_labels(self) -> None:
        for name in LABEL_COLUMNS:
            bad = ~np.isfinite(self.columns[name])
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"{name}: non-finite label {self.columns[name][i]} at record {i}")
        c = self.columns
        gap_error = np.abs(c["y"] - (c["lumo"] - c["homo"]))
        if gap_error.size and gap_error.max() > GAP_TOLERANCE:
            raise ValueError(f"y: must equal lumo - homo (off by up to {gap_error.max():.3g} eV)")

    def _validate_keys(self) -> None:
        if len(self) and self.columns["conformer_id"].min() < 0:
            raise ValueError("conformer_id: records need conformer_id >= 0 (-1 is for failures)")
        keys = self.keys()
        if "step" in self.columns:  # trajectory frames: a conformer's frames differ in their step
            keys = list(zip(keys, self.columns["step"].tolist()))
        if len(set(keys)) != len(keys):
            raise ValueError("molecule_id/conformer_id: duplicate (molecule_id, conformer_id) in batch")


def _check_array(name: str, value, dtype: np.dtype, shape: tuple) -> None:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {value.shape}")
    if value.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {value.dtype}")


def _check_column(name: str, value, dtype: np.dtype, n: int) -> None:
    _check_array(name, value, dtype, (n,))
    if name in STRING_COLUMNS and not all(isinstance(s, str) for s in value):
        raise ValueError(f"{name}: expected an object array of str")


def _cast(name: str, value, dtype: np.dtype | None) -> np.ndarray:
    if dtype is None:
        raise ValueError(f"RecordBatch: unknown column {name!r}")
    try:
        return np.asarray(value).astype(dtype, casting="same_kind", copy=False)
    except TypeError as e:
        raise ValueError(f"{name}: cannot cast to {dtype}: {e}") from None


def _as_strings(value) -> np.ndarray:
    out = np.empty(len(value), dtype=STRING_DTYPE)
    out[:] = [str(s) for s in value]
    return out
