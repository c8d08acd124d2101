"""Conformers: where a run's geometries come from, as validated :class:`pyscf_ipu.molecule.Molecule`.

Two sources, chosen by the run's input: :class:`EmbeddedConformers` embeds RDKit ETKDG conformers
of SMILES (``--smiles``, the default), :class:`FileConformers` takes the frames of geometry files
(``--geometries``; no RDKit needed). Both give each molecule's conformers with their
``conformer_id``, in a fixed order, so a resumed run finds what is done.

QM1B labels unrelaxed ETKDG conformers, so by default no force-field relaxation is applied
(``relax="mmff"`` opts into MMFF94). Every conformer is reproducible from ``(seed, molecule_id)``:
:func:`conformer_seed` derives RDKit's random seed from the run seed and the molecule's stable id,
so a molecule gets the same conformers whatever shard, limit or process it is generated in.

Failures of a whole molecule raise :class:`ConformerError`, whose ``reason`` is the short text the
generator writes to its failures table; a geometry file's frames fail one by one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.method import Method
from pyscf_ipu.molecule import Molecule, MoleculeError, validate
from pyscf_ipu.units import BOHR_PER_ANGSTROM

from .inputs import (GeometryInput, MoleculeInput, ParsedSmiles, builtin_sample, parse_smiles, read_geometries,
                     read_smiles, select)
from .schema import Failure

RELAX_METHODS = ("mmff",)
MMFF_MAX_ITERS = 2000  # RDKit's default of 200 leaves many 10-20 atom molecules unconverged

# RDKit seeds live in [1, 2**31 - 1]; we map molecule ids 0 .. 2**31 - 2 onto them one to one.
_SEED_DOMAIN = 2**31 - 1


class ConformerError(Exception):
    """A molecule for which no usable conformer can be made.

    ``reason`` is short and stable (e.g. "bad SMILES", "embedding failed"), for the failures table;
    ``str(err)`` adds the SMILES.
    """

    def __init__(self, reason: str, smiles: str = "") -> None:
        self.reason = reason
        self.smiles = smiles
        super().__init__(f"{reason}: {smiles}" if smiles else reason)


def _round_key(seed: int, round_index: int, half: int) -> int:
    """The Feistel round function: 16 pseudo-random bits from (seed, round, half)."""
    digest = hashlib.blake2b(f"{seed}:{round_index}:{half}".encode(), digest_size=2).digest()
    return int.from_bytes(digest, "little")


def _permute32(x: int, seed: int) -> int:
    """A seed-keyed permutation of the 32-bit integers (a 4-round Feistel network)."""
    left, right = x >> 16, x & 0xFFFF
    for r in range(4):
        left, right = right, left ^ _round_key(seed, r, right)
    return (left << 16) | right


def conformer_seed(seed: int, molecule_id: int) -> int:
    """RDKit's ``randomSeed`` for the conformers of one molecule: in [1, 2**31 - 1], never 0.

    A keyed pseudo-random permutation of the molecule ids, so that

    * it is deterministic and stable across processes, platforms and Python versions (it uses
      blake2b, not ``hash()``, which is salted per process);
    * different molecule ids always get different seeds for the same run ``seed`` (a permutation,
      made to fit the 2**31 - 1 possible seeds by cycle-walking), not merely with high probability;
    * neighbouring ids get unrelated seeds (RDKit's generator is a linear congruential one, where
      arithmetically related seeds could give related streams);
    * it is never 0, for which RDKit 2026.09 returns identical conformers.
    """
    if not 0 <= molecule_id < _SEED_DOMAIN:
        raise ValueError(f"molecule_id must be in [0, {_SEED_DOMAIN - 1}], got {molecule_id}")
    x = int(molecule_id)
    while True:  # cycle-walking: terminates because x's cycle returns into the domain
        x = _permute32(x, int(seed))
        if x < _SEED_DOMAIN:
            return x + 1


def _neutral(smiles: str, parsed: ParsedSmiles | None):
    """The RDKit molecule of a neutral, parsed ``smiles``; :class:`ConformerError` if there is none."""
    if parsed is None or not parsed.symbols:
        raise ConformerError("bad SMILES", smiles)
    if parsed.charge != 0:
        raise ConformerError(f"charged species (charge {parsed.charge:+d})", smiles)
    return parsed.molecule()


def embed_conformers(
    smiles: str, count: int, seed: int, molecule_id: int, relax: str | None = None, parsed: ParsedSmiles | None = None
) -> list[Molecule]:
    """Up to ``count`` ETKDGv3 conformers of ``smiles``, as validated molecules in Bohr.

    Hydrogens are added explicitly and follow the heavy atoms (RDKit's ``AddHs`` order). Each
    molecule is named ``"<molecule_id>:<conformer index>"``. The result is deterministic: the same
    arguments give bit-identical coordinates (see :func:`conformer_seed`).

    ``EmbedMultipleConfs`` may return fewer than ``count`` conformers (embedding attempts can fail
    for strained or crowded molecules); what it gives is returned, always at least one. Callers must
    use ``len(result)``, not ``count``.

    ``relax``: ``None`` (QM1B's choice: raw ETKDG geometries) or ``"mmff"`` (MMFF94 optimisation of
    every conformer; unconverged optimisations are kept as they are after ``MMFF_MAX_ITERS`` steps).
    ``parsed``: the SMILES already parsed (:func:`~qm1b.inputs.parse_smiles`), else it is parsed here.

    Raises :class:`ConformerError` for an unparsable SMILES, a charged species, a molecule ETKDG cannot
    embed, one MMFF has no parameters for, or an odd electron count (a radical: the reason is the
    :class:`~pyscf_ipu.molecule.MoleculeError` text); :class:`ValueError` for an unknown ``relax`` or
    ``count < 1``.
    """
    from rdkit import Chem, rdBase
    from rdkit.Chem import AllChem

    if relax is not None and relax not in RELAX_METHODS:
        raise ValueError(f"unknown relax method {relax!r}: use None or one of {', '.join(RELAX_METHODS)}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")

    mol = Chem.AddHs(_neutral(smiles, parse_smiles(smiles) if parsed is None else parsed))
    params = AllChem.ETKDGv3()
    params.randomSeed = conformer_seed(seed, molecule_id)
    params.numThreads = 1  # one thread per molecule: the generator's worker threads embed several at once
    with rdBase.BlockLogs():
        conf_ids = list(AllChem.EmbedMultipleConfs(mol, numConfs=count, params=params))
    if not conf_ids:
        raise ConformerError("embedding failed", smiles)

    if relax == "mmff":
        if not AllChem.MMFFHasAllMoleculeParams(mol):
            raise ConformerError("no MMFF parameters", smiles)
        AllChem.MMFFOptimizeMoleculeConfs(mol, numThreads=1, maxIters=MMFF_MAX_ITERS)

    numbers = np.array([atom.GetAtomicNum() for atom in mol.GetAtoms()], dtype=int)
    molecules = []
    for index, conf_id in enumerate(conf_ids):
        positions = np.asarray(mol.GetConformer(conf_id).GetPositions(), dtype=float) * BOHR_PER_ANGSTROM
        try:
            molecules.append(validate(Molecule(numbers, positions, charge=0, name=f"{molecule_id}:{index}")))
        except MoleculeError as err:  # odd electron count (radical), or atoms collapsed onto each other
            raise ConformerError(str(err), smiles) from None
    return molecules


Conformers = list[tuple[int, Molecule]]  # (conformer_id, conformer) of one molecule


def _bucket(symbols, method: Method, charge: int = 0) -> SizeBucket | None:
    try:
        return method.bucket_of(list(symbols), charge)
    except Exception:  # an element the basis lacks, or none at all: the run records the failure
        return None


@dataclass(frozen=True)
class EmbeddedConformers:
    """RDKit ETKDG conformers of the SMILES in ``smiles`` (a file; None: the built-in sample)."""

    smiles: str | None
    count: int
    seed: int
    relax: str | None = None

    def settings(self) -> dict:
        """What defines the conformers, for the run's label settings."""
        return {"conformers": self.count, "seed": self.seed, "relax": self.relax,
                "smiles": self.smiles or "builtin:gdb_sample"}  # fmt: skip

    def inputs(self, heavy_atoms: tuple[int, int] | None, limit: int | None, shard: tuple[int, int]
               ) -> list[MoleculeInput]:  # fmt: skip
        """The input's molecules, selected (:func:`qm1b.inputs.select`)."""
        inputs = read_smiles(self.smiles) if self.smiles else builtin_sample()
        return select(inputs, heavy_atoms=heavy_atoms, limit=limit, shard=shard)

    def expected(self, entry: MoleculeInput) -> int:
        """How many conformers the molecule is asked for (the progress bar's share)."""
        return self.count

    def symbols(self, entry: MoleculeInput) -> tuple[str, ...]:
        """The molecule's atoms, hydrogens added (none if RDKit cannot read it)."""
        return () if entry.parsed is None else entry.parsed.symbols

    def bucket(self, entry: MoleculeInput, method: Method) -> SizeBucket | None:
        """The molecule's size bucket under ``method`` (its atoms with hydrogens added); None if RDKit
        cannot read it or the basis lacks one of its elements (the run records the failure)."""
        parsed = entry.parsed
        if parsed is None:
            return None
        return _bucket(parsed.symbols, method, parsed.charge)

    def conformers(self, entry: MoleculeInput) -> tuple[Conformers, list[Failure]]:
        """The molecule's conformers (no failures of single conformers); :class:`ConformerError` if none."""
        molecules = embed_conformers(entry.smiles, self.count, self.seed, entry.molecule_id, self.relax, entry.parsed)
        return list(enumerate(molecules)), []


@dataclass(frozen=True)
class FileConformers:
    """The frames of the geometry file (or directory of files) ``geometries``."""

    geometries: str

    def settings(self) -> dict:
        return {"geometries": self.geometries}

    def inputs(self, heavy_atoms: tuple[int, int] | None, limit: int | None, shard: tuple[int, int]
               ) -> list[GeometryInput]:  # fmt: skip
        return select(read_geometries(self.geometries), heavy_atoms=heavy_atoms, limit=limit, shard=shard)

    def expected(self, entry: GeometryInput) -> int:
        return len(entry.frames)

    def symbols(self, entry: GeometryInput) -> tuple[str, ...]:
        return tuple(entry.frames[0].symbols)

    def bucket(self, entry: GeometryInput, method: Method) -> SizeBucket | None:
        return _bucket(entry.frames[0].symbols, method, entry.frames[0].charge)

    def conformers(self, entry: GeometryInput) -> tuple[Conformers, list[Failure]]:
        """The frames that are closed-shell, neutral molecules; each other frame is a failure with its
        reason (an unknown element, an odd electron count, atoms on top of each other, ...)."""
        good, failures = [], []
        for cid, frame in enumerate(entry.frames):
            try:
                if frame.charge:
                    raise MoleculeError(f"charged species (charge {frame.charge:+d})")
                good.append((cid, frame.molecule()))
            except MoleculeError as err:
                failures.append(Failure(frame.source, str(err), entry.molecule_id, cid))
        return good, failures


ConformerSource = EmbeddedConformers | FileConformers
