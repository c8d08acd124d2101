"""Inputs: SMILES files (.smi/.txt/.csv), the built-in GDB-like sample, geometry files (XYZ, QM9's
XYZ, SDF), and the selection of a run's share.

Every molecule gets a stable ``molecule_id``: its 0-based position in the input, counting only
SMILES entries (comments and blank lines are skipped) or, in geometry files, molecules (a run of
frames of one molecule). Selection never renumbers, so a molecule keeps its id, and therefore its
conformer seeds and its place in the output, under any ``--limit``, ``--shard`` or ``--heavy-atoms``.
RDKit is imported only to read SMILES.
"""

from __future__ import annotations

import csv
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

from pyscf_ipu.geometries import Frame, file_format, open_text, read_frames
from pyscf_ipu.molecule import MoleculeError

SMI_SUFFIXES = (".smi", ".txt")
CSV_SUFFIXES = (".csv",)
SAMPLE_RESOURCE = "data/gdb_sample.smi"
_ID_COLUMNS = ("id", "name")  # first present wins


class InputError(ValueError):
    """Bad input file or selection argument; the message names the file (and line) or the argument."""


@dataclass(frozen=True)
class MoleculeInput:
    """One input molecule."""

    molecule_id: int  # 0-based position among the file's SMILES entries: stable under any selection
    smiles: str
    name: str = ""  # the .smi line's id column, or the CSV's id/name column

    @property
    def description(self) -> str:
        """What names the molecule in the failures table: its SMILES."""
        return self.smiles

    @cached_property
    def parsed(self) -> ParsedSmiles | None:
        """The SMILES as RDKit reads it, parsed once per input (None if it cannot)."""
        return parse_smiles(self.smiles)

    @property
    def heavy_atoms(self) -> int | None:
        """Its heavy atoms (RDKit); None if RDKit cannot parse the SMILES."""
        return None if self.parsed is None else self.parsed.heavy_atoms


@dataclass(frozen=True, eq=False)
class GeometryInput:
    """One molecule of a geometry file: consecutive frames with the same atoms in the same order (and
    the same bonds, charge and SMILES where the file gives them) are its conformers, in file order."""

    molecule_id: int  # 0-based position among the input's molecules
    frames: tuple[Frame, ...]

    @property
    def smiles(self) -> str:
        """What the file gives (QM9's GDB SMILES, an SDF <SMILES> item), else ""."""
        return self.frames[0].smiles

    @property
    def description(self) -> str:
        """What names the molecule in the failures table: where it starts in its file, and its SMILES."""
        return " ".join(filter(None, [self.frames[0].source, self.smiles]))

    @property
    def heavy_atoms(self) -> int:
        return sum(s.strip().upper() not in ("H", "1") for s in self.frames[0].symbols)


Input = MoleculeInput | GeometryInput  # one molecule of a run's input


def _parse_smi(lines: Iterable[str]) -> list[MoleculeInput]:
    """'SMILES [id]' lines. Only whole-line comments: '#' inside a SMILES is a triple bond."""
    out = []
    for line in lines:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        smiles, *rest = text.split(None, 1)  # tab or spaces before the id
        out.append(MoleculeInput(len(out), smiles, rest[0].strip() if rest else ""))
    return out


def _parse_csv(handle: Iterable[str], source: str) -> list[MoleculeInput]:
    reader = csv.reader(handle)
    header = next(reader, None)
    if header is None:
        raise InputError(f"{source}: empty file (expected a header line with a 'smiles' column)")
    keys = [h.strip().lower() for h in header]
    if "smiles" not in keys:
        shown = ", ".join(repr(h) for h in header)
        raise InputError(f"{source}:1: no 'smiles' column in the header (found {shown})")
    smiles_col = keys.index("smiles")
    name_col = next((keys.index(k) for k in _ID_COLUMNS if k in keys), None)
    out = []
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue  # blank line
        smiles = row[smiles_col].strip() if smiles_col < len(row) else ""
        if not smiles:
            raise InputError(f"{source}:{reader.line_num}: empty SMILES cell")
        name = row[name_col].strip() if name_col is not None and name_col < len(row) else ""
        out.append(MoleculeInput(len(out), smiles, name))
    return out


def read_smiles(path: str | Path) -> list[MoleculeInput]:
    """Read molecules from a SMILES file.

    * ``.smi`` / ``.txt``: one SMILES per line, optionally followed by whitespace and an id (GDB-11's
      format); lines starting with '#' and blank lines are skipped.
    * ``.csv``: a header with a ``smiles`` column (any case) and optionally an ``id`` or ``name`` column.

    Any of these may be gzip-compressed (``.smi.gz``). Raises :class:`InputError` naming the file
    (and line) for a missing or unreadable file, an unknown extension, a CSV without a smiles column,
    an empty SMILES cell, or an input without any SMILES.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    suffixes = [s.lower() for s in path.suffixes]
    kind = suffixes[-2] if len(suffixes) >= 2 and suffixes[-1] == ".gz" else (suffixes[-1] if suffixes else "")
    if kind not in SMI_SUFFIXES + CSV_SUFFIXES:
        raise InputError(
            f"{path}: unknown input format {kind or '(no extension)'!r}: use .smi, .txt or .csv (optionally .gz)"
        )
    try:
        with open_text(path) as handle:
            inputs = _parse_csv(handle, str(path)) if kind in CSV_SUFFIXES else _parse_smi(handle)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise InputError(f"{path}: cannot read: {err}") from None
    if not inputs:
        raise InputError(f"{path}: no SMILES found (the file has only comments or blank lines)")
    return inputs


def builtin_sample() -> list[MoleculeInput]:
    """The built-in sample: ~100 GDB-like molecules with 9-11 heavy atoms (see the file's header)."""
    resource = resources.files(__package__).joinpath(SAMPLE_RESOURCE)
    return _parse_smi(resource.read_text(encoding="utf-8").splitlines())


def read_geometries(path: str | Path) -> list[GeometryInput]:
    """The molecules of a geometry file (XYZ, SDF or qm9pack's CSV: :mod:`pyscf_ipu.geometries`), or of
    every XYZ and SDF file in a directory (in order of their names; QM9's own files, for one).

    Frames are grouped into molecules within each file (see :class:`GeometryInput`); a new file
    starts a new molecule. Raises :class:`InputError` naming the file (and line) for a missing path,
    a directory without geometry files, an unknown format, a broken layout, or no frames at all.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    files = sorted(p for p in path.iterdir() if file_format(p) in ("xyz", "sdf")) if path.is_dir() else [path]
    if not files:
        raise InputError(f"{path}: no geometry files in this directory (.xyz, .sdf, .sd or .mol, optionally .gz)")
    molecules: list[GeometryInput] = []
    for file in files:
        try:
            frames = read_frames(file)
        except MoleculeError as err:
            raise InputError(str(err)) from None
        for _, group in itertools.groupby(frames, key=lambda frame: frame.identity):  # runs of one molecule
            molecules.append(GeometryInput(len(molecules), tuple(group)))
    if not molecules:
        raise InputError(f"{path}: no geometries found")
    return molecules


@dataclass(frozen=True)
class ParsedSmiles:
    """What a run needs of a SMILES, from one RDKit parse: its atoms for the size bucket and the
    heavy-atom filter, and RDKit's molecule (as its compact binary) for the conformer embedding."""

    symbols: tuple[str, ...]  # every atom, hydrogens added (RDKit's AddHs order)
    charge: int  # the formal charge
    heavy_atoms: int
    binary: bytes  # ``Chem.Mol.ToBinary()`` of the parsed molecule, without added hydrogens

    def molecule(self):
        """RDKit's molecule again, from its binary (no second SMILES parse)."""
        from rdkit import Chem

        return Chem.Mol(self.binary)


def parse_smiles(smiles: str) -> ParsedSmiles | None:
    """``smiles`` parsed by RDKit, or None if it cannot be (the generator records that failure)."""
    from rdkit import Chem, rdBase

    with rdBase.BlockLogs():  # unparsable SMILES are expected here; they fail later, with a record
        mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    symbols = tuple(atom.GetSymbol() for atom in Chem.AddHs(mol).GetAtoms())
    return ParsedSmiles(symbols, Chem.GetFormalCharge(mol), mol.GetNumHeavyAtoms(), mol.ToBinary())


def heavy_atom_count(smiles: str) -> int | None:
    """The number of non-hydrogen atoms of ``smiles`` (RDKit), or None if RDKit cannot parse it."""
    parsed = parse_smiles(smiles)
    return None if parsed is None else parsed.heavy_atoms


def _check_range(heavy_atoms: tuple[int, int]) -> None:
    lo, hi = heavy_atoms
    if not 0 <= lo <= hi:
        raise InputError(f"heavy-atom range {lo}-{hi}: need 0 <= low <= high, e.g. 9-11")


def _check_shard(shard: tuple[int, int]) -> None:
    i, n = shard
    if not (n >= 1 and 0 <= i < n):
        raise InputError(f"shard {i}/{n}: need 0 <= index < count, e.g. 0/8 for the first of 8 shards")


def select(
    inputs: Iterable[Input],
    *,
    heavy_atoms: tuple[int, int] | None = None,
    limit: int | None = None,
    shard: tuple[int, int] = (0, 1),
) -> list[Input]:
    """A run's share of ``inputs``, ids unchanged.

    1. ``heavy_atoms=(lo, hi)``: keep molecules with lo..hi heavy atoms (inclusive). Unparsable SMILES
       are kept, so that the generator records them as failures instead of silently dropping them.
    2. ``shard=(i, n)``: keep ``molecule_id % n == i``: deterministic, and shards 0..n-1 are disjoint
       and together complete, whatever the other options.
    3. ``limit``: the first ``limit`` molecules of the shard, after filtering.
    """
    if heavy_atoms is not None:
        _check_range(heavy_atoms)
    _check_shard(shard)
    if limit is not None and limit < 0:
        raise InputError(f"limit must be >= 0, got {limit}")
    i, n = shard

    def keep(entry: Input) -> bool:
        if heavy_atoms is None:
            return True
        count = entry.heavy_atoms
        return count is None or heavy_atoms[0] <= count <= heavy_atoms[1]

    # The shard test depends on the id only, so it commutes with the filter: applying it first, and
    # stopping at the limit, parses only the SMILES that can end up in the result.
    chosen: Iterator[Input] = (e for e in inputs if e.molecule_id % n == i and keep(e))
    return list(itertools.islice(chosen, limit))


_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", re.ASCII)
_SHARD = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*", re.ASCII)


def parse_range(text: str) -> tuple[int, int]:
    """'9-11' -> (9, 11); '9' -> (9, 9). Raises :class:`InputError` for anything else."""
    match = _RANGE.fullmatch(text or "")
    if not match:
        raise InputError(f"heavy-atom range {text!r}: expected LOW-HIGH or N, e.g. 9-11 or 9")
    lo = int(match[1])
    hi = int(match[2]) if match[2] is not None else lo
    if lo > hi:
        raise InputError(f"heavy-atom range {text!r}: the low end is above the high end; e.g. 9-11")
    return lo, hi


def parse_shard(text: str) -> tuple[int, int]:
    """'2/8' -> (2, 8): shard 2 of 8, counted from 0. Raises :class:`InputError` for anything else."""
    match = _SHARD.fullmatch(text or "")
    if not match:
        raise InputError(f"shard {text!r}: expected INDEX/COUNT, e.g. 0/8 for the first of 8 shards")
    shard = int(match[1]), int(match[2])
    _check_shard(shard)
    return shard
