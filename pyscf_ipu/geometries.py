"""Geometries from files: XYZ (one frame or many, QM9's variant included) and SDF, and the user's
choice of one molecule (:func:`parse_molecule`).

A file holds frames: one geometry each, in Angstrom, in the order written. The readers keep what a
file says as it says it (symbols as text, the title or comment, a SMILES where the file gives one,
SDF's bonds and formal charges), and :meth:`Frame.molecule` turns one frame into a validated
:class:`~pyscf_ipu.molecule.Molecule`. A file whose layout is broken (a count line that is not a
number, a frame cut short) raises :class:`~pyscf_ipu.molecule.MoleculeError` naming the file and
line; a frame that is laid out correctly but cannot be a molecule (an unknown element, a coordinate
that is not a number, hydrogens left implicit in an SDF) keeps its ``problem``, so that the other
frames of the file can still be used.

Formats:

- **XYZ**: an atom count, a comment line, then ``symbol x y z`` per atom; frames follow one another.
  Further columns on an atom line are ignored (extended XYZ's, QM9's Mulliken charges).
- **QM9's XYZ** (``dsgdb9nsd_*.xyz``): a comment starting ``gdb N``, numbers such as ``1.2*^-6``,
  and three lines after the atoms (frequencies, the GDB and relaxed SMILES, the InChIs); the GDB
  SMILES is kept.
- **qm9pack's CSV files** (``qm9pack/data/qm9_part*.csv``, QM9 as the PyPI package ships it): a
  row per molecule, with its ``Elements``, ``XYZ_Ang`` and ``SMILES`` columns.
- **SDF / MOL** (V2000 and V3000 connection tables): the title line, the atoms with their formal
  charges (``M  CHG`` lines replace the atom block's), the bonds, and a ``<SMILES>`` data item if
  present; records end with ``$$$$``. Every hydrogen must be written out: where the bonds leave an
  atom short of its usual valence, the frame's problem says so.

Files may be gzip-compressed (``.xyz.gz``, ``.sdf.gz``).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from .molecule import Molecule, MoleculeError, atomic_number, from_atom_string, from_name, validate
from .units import BOHR_PER_ANGSTROM

XYZ_SUFFIXES = (".xyz",)
SDF_SUFFIXES = (".sdf", ".sd", ".mol")
CSV_SUFFIXES = (".csv",)  # qm9pack's layout
QM9_CSV_COLUMNS = ("Index", "SMILES", "Elements", "XYZ_Ang")
QM9_COMMENT = re.compile(r"gdb\s+\d+")
# An atom's usual valence, to tell hydrogens left implicit (an SDF written without them); atoms
# with a formal charge or of other elements are not checked.
VALENCE = {"H": 1, "B": 3, "C": 4, "N": 3, "O": 2, "F": 1, "Si": 4, "P": 3, "S": 2, "Cl": 1, "Br": 1, "I": 1}
BOND_ORDER = {1: 1.0, 2: 2.0, 3: 3.0, 4: 1.5}  # SDF bond types: single, double, triple, aromatic
RADICAL = "a radical (the file marks unpaired electrons): restricted Kohn-Sham needs a closed shell"
V2000_CHARGE = {0: 0, 1: 3, 2: 2, 3: 1, 4: 0, 5: -1, 6: -2, 7: -3}  # the atom block's charge codes (4: radical)


@dataclass(frozen=True, eq=False)
class Frame:
    """One geometry as a file gives it."""

    symbols: tuple[str, ...]  # element symbols (or atomic numbers) as written
    positions: np.ndarray  # (natom, 3) Angstrom
    charge: int = 0  # total formal charge (SDF); 0 where the format has none
    title: str = ""  # the XYZ comment or the SDF title line
    smiles: str = ""  # a SMILES the file gives (QM9's GDB SMILES, an SDF <SMILES> item), else ""
    source: str = ""  # "FILE:LINE" of the frame's first line
    bonds: tuple[tuple[int, int, int], ...] = ()  # SDF: (atom, atom, bond type), atoms from 0
    problem: str = ""  # why the frame cannot be a molecule, found while reading ("" if none)

    @property
    def identity(self) -> tuple:
        """What two frames of one molecule share: atoms in order, charge, bonds and SMILES."""
        return (self.symbols, self.charge, self.bonds, self.smiles)

    def molecule(self, name: str = "", spin: int = 0) -> Molecule:
        """The frame as a validated molecule in Bohr; :class:`MoleculeError` says why it cannot be one."""
        if self.problem:
            raise MoleculeError(self.problem)
        numbers = np.array([atomic_number(s) for s in self.symbols], int)
        return validate(Molecule(numbers, self.positions * BOHR_PER_ANGSTROM, self.charge, spin, name, self.title))


def open_text(path: Path) -> TextIO:
    """The file as text; ``.gz`` files are decompressed on the fly. ``utf-8-sig``: files saved by some
    editors and spreadsheets start with a byte-order mark."""
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open("r", encoding="utf-8-sig", newline="")


def file_format(path: Path) -> str:
    """'xyz', 'sdf' or 'csv' from the file's suffix (a ``.gz`` suffix looks through); '' if none."""
    suffixes = [s.lower() for s in path.suffixes]
    kind = suffixes[-2] if len(suffixes) >= 2 and suffixes[-1] == ".gz" else (suffixes[-1] if suffixes else "")
    formats = {"xyz": XYZ_SUFFIXES, "sdf": SDF_SUFFIXES, "csv": CSV_SUFFIXES}
    return next((name for name, known in formats.items() if kind in known), "")


def read_frames(path: str | Path) -> list[Frame]:
    """Every frame of an XYZ, SDF or qm9pack CSV file, in order (see the module doc)."""
    path = Path(path)
    kind = file_format(path)
    if not kind:
        raise MoleculeError(f"{path}: unknown geometry format: use .xyz, .sdf, .sd, .mol or qm9pack's .csv "
                            "(optionally .gz)")  # fmt: skip
    try:
        with open_text(path) as handle:
            if kind == "csv":
                return _qm9_csv_frames(handle, path.name)
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError, EOFError, csv.Error) as err:
        raise MoleculeError(f"cannot read {str(path)!r}: {getattr(err, 'strerror', None) or err}") from None
    return _xyz_frames(lines, path.name) if kind == "xyz" else _sdf_frames(lines, path.name)


def _number(text: str) -> float:
    return float(text.replace("*^", "e"))  # QM9 writes exponents as Mathematica does: 1.2*^-6


def _atoms(rows: list[list[str]]) -> tuple[tuple[str, ...], np.ndarray, str]:
    """Symbols, positions (natom, 3) and a problem ("" if none) from rows of 'symbol x y z ...'."""
    symbols, positions, problem = [], np.full((len(rows), 3), np.nan), ""
    for k, parts in enumerate(rows):
        symbols.append(parts[0] if parts else "")
        try:
            positions[k] = [_number(x) for x in parts[1:4]]
        except ValueError:
            problem = problem or f"atom {k + 1}: expected 'symbol x y z', got {' '.join(parts)!r}"
    return tuple(symbols), positions, problem


def _xyz_frames(lines: list[str], source: str) -> list[Frame]:
    frames, k = [], 0
    while True:
        while k < len(lines) and not lines[k].strip():  # blank lines between frames and at the end
            k += 1
        if k == len(lines):
            return frames
        start = k
        try:
            count = int(lines[k].split()[0])
        except ValueError:
            what = "the first line of an XYZ file" if not frames else "each frame's first line"
            raise MoleculeError(f"{source}:{k + 1}: {what} must be the atom count, got {lines[k].strip()!r}") from None
        atom_lines = lines[k + 2 : k + 2 + count]
        body = [line for line in atom_lines if line.strip()]
        if len(body) != count:
            raise MoleculeError(f"{source}:{start + 1}: the header says {count} atoms but {len(body)} atom lines "
                                "follow")  # fmt: skip
        title = lines[k + 1].strip() if k + 1 < len(lines) else ""
        symbols, positions, problem = _atoms([line.split() for line in body])
        k += 2 + count
        smiles = ""
        qm9_trailer = k + 3 <= len(lines) and not lines[k].strip().isdigit()  # not the next frame's count
        if QM9_COMMENT.match(title) and qm9_trailer:  # frequencies, SMILES (GDB, relaxed), InChIs
            smiles = (lines[k + 1].split() or [""])[0]
            k += 3
        frames.append(Frame(symbols, positions, 0, title, smiles, f"{source}:{start + 1}", (), problem))


def _qm9_csv_frames(handle: TextIO, source: str) -> list[Frame]:
    csv.field_size_limit(1 << 24)
    reader = csv.DictReader(handle)
    missing = [c for c in QM9_CSV_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise MoleculeError(f"{source}: a CSV of geometries needs qm9pack's columns {', '.join(QM9_CSV_COLUMNS)}; "
                            f"missing {', '.join(missing)}")  # fmt: skip
    return [qm9_frame(row, f"{source}:{reader.line_num}") for row in reader]


def qm9_frame(row: dict, source: str = "") -> Frame:
    """One row of qm9pack's CSV files as a frame, titled ``gdb INDEX`` as QM9's own files are."""
    title, smiles = f"gdb {row['Index']}", row["SMILES"] or ""
    try:
        symbols = tuple(json.loads((row["Elements"] or "").replace("'", '"')))
        positions = _numbers(row["XYZ_Ang"] or "").reshape(len(symbols), 3)
    except ValueError:  # a malformed cell (JSON's errors are ValueErrors too)
        problem = f"cannot read its Elements and XYZ_Ang cells: {str(row['Elements'])[:40]!r}"
        return Frame((), np.zeros((0, 3)), 0, title, smiles, source, (), problem)
    return Frame(symbols, positions, 0, title, smiles, source)


def _numbers(text: str) -> np.ndarray:
    """'[[0.5,0.,1.],...]' -> array. qm9pack writes floats like '0.' and '1.2*^-6', which JSON rejects."""
    tokens = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:(?:[eE]|\*\^)[-+]?\d+)?", text)
    return np.array([_number(t) for t in tokens], float)


def _sdf_frames(lines: list[str], source: str) -> list[Frame]:
    frames, start = [], 0
    for k, line in enumerate([*lines, "$$$$"]):
        if line.rstrip() != "$$$$":
            continue
        record = lines[start:k]
        if any(r.strip() for r in record):  # not the blank lines after the last record
            frames.append(_sdf_record(record, f"{source}:{start + 1}"))
        start = k + 1
    return frames


def _sdf_record(record: list[str], source: str) -> Frame:
    if len(record) < 4:
        raise MoleculeError(f"{source}: an SDF record needs a title, two header lines and a counts line")
    counts = record[3]
    block = _v3000 if "V3000" in counts else _v2000
    try:
        symbols, positions, charges, bonds, problem, end = block(record, counts)
    except (ValueError, IndexError):
        raise MoleculeError(f"{source}: cannot read this record's connection table (counts line "
                            f"{counts.strip()!r})") from None  # fmt: skip
    problem = problem or _implicit_hydrogens(symbols, charges, bonds)
    return Frame(symbols, positions, int(sum(charges)), record[0].strip(), _sdf_smiles(record[end:]), source, bonds,
                 problem)  # fmt: skip


def _v2000(record: list[str], counts: str):
    natoms, nbonds = int(counts[0:3]), int(counts[3:6])
    atom_lines, end = record[4 : 4 + natoms], 4 + natoms + nbonds
    if len(atom_lines) < natoms:
        raise IndexError
    rows = []
    for line in atom_lines:  # fixed columns; where a writer misaligned them, 'x y z symbol' by whitespace
        fixed = [line[31:34].strip(), line[0:10], line[10:20], line[20:30]]
        rows.append(fixed if fixed[0] else line.split()[3:4] + line.split()[0:3])
    codes = [_field(line[36:39]) for line in atom_lines]
    charges = [V2000_CHARGE.get(code, 0) for code in codes]
    bond_lines = record[4 + natoms : end]
    bonds = tuple((_field(line[0:3]) - 1, _field(line[3:6]) - 1, _field(line[6:9])) for line in bond_lines)
    symbols, positions, problem = _atoms(rows)
    properties = record[end:]
    listed = [line for line in properties if line.startswith("M  CHG")]
    if listed:  # M  CHG lines replace the atom block's charges
        charges = [0] * natoms
        for line in listed:
            values = [int(v) for v in line[6:].split()[1:]]
            for atom, charge in zip(values[0::2], values[1::2]):
                charges[atom - 1] = charge
    if 4 in codes or any(line.startswith("M  RAD") for line in properties):
        problem = problem or RADICAL
    return symbols, positions, charges, bonds, problem, end


def _field(text: str) -> int:
    """A fixed-width integer field of a V2000 line; blank counts as 0."""
    return int(text) if text.strip() else 0


def _v3000(record: list[str], counts: str):
    entries, text = [], ""
    for line in record[4:]:  # "M  V30 ..." lines; a trailing '-' continues on the next
        if line.startswith("M  V30 "):
            text += line[7:].rstrip()
            if text.endswith("-"):
                text = text[:-1]
                continue
            entries.append(text)
            text = ""
    section, rows, charges, bonds, radical = "", [], [], [], False
    for entry in entries:
        words = entry.split()
        if words[:1] in (["BEGIN"], ["END"]):
            section = words[1] if words[0] == "BEGIN" else ""
        elif section == "ATOM":
            options = dict(w.split("=", 1) for w in words[6:] if "=" in w)
            rows.append(words[1:5])
            charges.append(int(options.get("CHG", 0)))
            radical |= int(options.get("RAD", 0)) > 0
        elif section == "BOND":
            bonds.append((int(words[2]) - 1, int(words[3]) - 1, int(words[1])))
    symbols, positions, problem = _atoms(rows)
    if radical:
        problem = problem or RADICAL
    end = next((k for k, line in enumerate(record) if line.startswith("M  END")), len(record))
    return symbols, positions, charges, tuple(bonds), problem, end


def _sdf_smiles(items: list[str]) -> str:
    """The value of a ``<SMILES>`` (or ``<smile>``) data item, else ""."""
    for k, line in enumerate(items[:-1]):
        name = re.search(r"<([^>]*)>", line) if line.startswith(">") else None
        if name and name[1].strip().lower() in ("smiles", "smile"):
            return items[k + 1].strip()
    return ""


def _implicit_hydrogens(symbols: tuple[str, ...], charges: list[int], bonds: tuple) -> str:
    """Where the bonds leave an uncharged atom short of its usual valence: hydrogens the file left
    implicit, so that the geometry lacks atoms. "" if none, or if the record lists no bonds at all
    between several atoms (some writers omit them)."""
    if not bonds and len(symbols) > 1:
        return ""
    order = np.zeros(len(symbols))
    for a, b, kind in bonds:
        order[[a, b]] += BOND_ORDER.get(kind, 1.0)
    for k, (symbol, charge) in enumerate(zip(symbols, charges)):
        valence = VALENCE.get(symbol)
        if valence is not None and charge == 0 and order[k] < valence - 0.25:
            return (f"implicit hydrogens: atom {k + 1} ({symbol}) has bonds of total order {order[k]:g}, short of "
                    f"{valence}; write every hydrogen explicitly (RDKit: Chem.AddHs(mol, addCoords=True))")  # fmt: skip
    return ""


def from_xyz(path: str | Path, charge: int = 0, spin: int = 0) -> Molecule:
    """Read an XYZ file of one frame: atom count, a comment line, then 'symbol x y z' in Angstrom."""
    path = Path(path)
    try:
        frames = _xyz_frames(path.read_text().splitlines(), str(path))
    except OSError as err:
        raise MoleculeError(f"cannot read XYZ file {str(path)!r}: {err.strerror}") from None
    if len(frames) != 1:
        raise MoleculeError(f"{path}: holds {len(frames)} frames; give a file of one (qm1b generate --geometries "
                            "labels every frame of a file)")  # fmt: skip
    return dataclasses.replace(frames[0], charge=charge).molecule(name=path.stem, spin=spin)


def parse_molecule(
    *,
    xyz: str | Path | None = None,
    atoms: str | None = None,
    mol: str | None = None,
    unit: str = "angstrom",
    charge: int = 0,
    spin: int = 0,
) -> Molecule:
    """Exactly one of ``xyz`` (file), ``atoms`` (atom string) or ``mol`` (a name) -> a validated Molecule."""
    given = [k for k, v in (("xyz", xyz), ("atoms", atoms), ("mol", mol)) if v is not None]
    if len(given) != 1:
        raise MoleculeError("give exactly one of --xyz FILE, --atoms STRING or --mol NAME")
    if xyz is not None:
        return from_xyz(xyz, charge=charge, spin=spin)
    if atoms is not None:
        return from_atom_string(atoms, unit=unit, charge=charge, spin=spin)
    named = from_name(mol)
    if charge or spin:
        return validate(Molecule(named.atomic_numbers, named.positions, charge, spin, named.name))
    return named


def extxyz_frame(symbols, positions_angstrom: np.ndarray, *, energy_ev: float | None = None,
                 forces_ev_per_angstrom: np.ndarray | None = None, info: dict | None = None) -> str:  # fmt: skip
    """One frame of extended XYZ (the ASE and MLIP trainers' format): the atom count, a comment line of
    ``key=value`` pairs (``Properties`` describes the atom columns; ``energy`` in eV; ``info``'s items,
    strings quoted), then one line per atom: symbol, position (Angstrom) and, where given, the force
    (eV/Angstrom, -dE/dR). Ends with a newline."""
    properties = "species:S:1:pos:R:3" + (":forces:R:3" if forces_ev_per_angstrom is not None else "")
    pairs = {"Properties": properties, **({"energy": f"{energy_ev:.10f}"} if energy_ev is not None else {})}
    for key, value in (info or {}).items():
        pairs[key] = '"' + str(value).replace('"', "'") + '"' if isinstance(value, str) else str(value)
    pairs["pbc"] = '"F F F"'
    columns = [positions_angstrom] + ([forces_ev_per_angstrom] if forces_ev_per_angstrom is not None else [])
    rows = np.concatenate(columns, axis=1)  # (natm, 3 or 6)
    lines = [str(len(symbols)), " ".join(f"{k}={v}" for k, v in pairs.items())]
    lines += [f"{s:2s} " + " ".join(f"{x:16.10f}" for x in row) for s, row in zip(symbols, rows)]
    return "\n".join(lines) + "\n"
