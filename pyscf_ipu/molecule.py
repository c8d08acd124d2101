"""Molecules: the closed-shell molecule, its validation, atom strings and named molecules.

A :class:`Molecule` is the first stage of the data flow. Positions are stored in Bohr; every parser
converts from the user's unit (files: :mod:`pyscf_ipu.geometries`). Validation happens once, here,
so that later stages may assume a well-formed closed-shell molecule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from pyscf.data.elements import ELEMENTS

from .units import BOHR_PER_ANGSTROM

MIN_DISTANCE_ANGSTROM = 0.1
_SYMBOL_TO_Z = {sym.upper(): z for z, sym in enumerate(ELEMENTS) if z > 0}


class MoleculeError(ValueError):
    """Bad molecule input. The message names the offending input and what to do about it."""


@dataclass(frozen=True, eq=False)
class Molecule:
    """A closed-shell molecule: atomic numbers and positions in Bohr.

    Construct it through :func:`parse_molecule` (or the ``from_*`` helpers), which validate.
    """

    atomic_numbers: np.ndarray  # (natom,) int
    positions: np.ndarray  # (natom, 3) Bohr
    charge: int = 0
    spin: int = 0  # 2S, as in PySCF
    name: str = ""
    comment: str = field(default="", repr=False)

    @property
    def natom(self) -> int:
        return len(self.atomic_numbers)

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(ELEMENTS[z] for z in self.atomic_numbers)

    @property
    def nelectron(self) -> int:
        return int(np.sum(self.atomic_numbers)) - self.charge

    @property
    def formula(self) -> str:
        """Atoms in input order, concatenated, as QM1B's ``atoms`` column (e.g. "COHH")."""
        return "".join(self.symbols)

    def pyscf_atom(self) -> list[tuple[str, tuple[float, float, float]]]:
        """The atom list for ``pyscf.gto.M(atom=..., unit="Bohr")``."""
        return [(s, tuple(float(x) for x in p)) for s, p in zip(self.symbols, self.positions)]

    def with_positions(self, positions_bohr: np.ndarray) -> Molecule:
        """The same atoms at new positions (Bohr), validated again."""
        return validate(
            Molecule(self.atomic_numbers, np.asarray(positions_bohr, float), self.charge, self.spin, self.name)
        )


# Reference geometries in Angstrom (experimental or standard bond lengths; paracetamol, 11 heavy
# atoms and 172 AOs in 6-31g*, is an RDKit ETKDG conformer relaxed with MMFF94).
NAMED_MOLECULES: dict[str, str] = {
    "h2": "H 0 0 0; H 0 0 0.74",
    "water": "O 0 0 0.1173; H 0 0.7572 -0.4692; H 0 -0.7572 -0.4692",
    "methane": (
        "C 0 0 0; H 0.6276 0.6276 0.6276; H -0.6276 -0.6276 0.6276; "
        "H -0.6276 0.6276 -0.6276; H 0.6276 -0.6276 -0.6276"
    ),
    "benzene": "; ".join(
        [f"C {1.3915 * math.cos(k * math.pi / 3):.6f} {1.3915 * math.sin(k * math.pi / 3):.6f} 0" for k in range(6)]
        + [f"H {2.4715 * math.cos(k * math.pi / 3):.6f} {2.4715 * math.sin(k * math.pi / 3):.6f} 0" for k in range(6)]
    ),
    "paracetamol": (
        "C -3.6645 -0.5774 -0.0163; C -2.2115 -0.8955 -0.2688; O -1.8819 -1.9716 -0.7542; "
        "N -1.3791 0.1527 0.0800; C 0.0262 0.2051 -0.0235; C 0.8145 -0.8440 -0.5033; "
        "C 2.2065 -0.7144 -0.5745; C 2.8084 0.4685 -0.1636; O 4.1596 0.6358 -0.2164; "
        "C 2.0426 1.5214 0.3165; C 0.6534 1.3898 0.3866; H -4.0643 -0.0139 -0.8633; "
        "H -4.2257 -1.5094 0.0977; H -3.7841 0.0040 0.9025; H -1.8247 0.9846 0.4455; "
        "H 0.3767 -1.7816 -0.8314; H 2.7931 -1.5462 -0.9517; H 4.5570 -0.1767 -0.5711; "
        "H 2.5236 2.4416 0.6352; H 0.0743 2.2273 0.7657"
    ),
}


def atomic_number(symbol: str) -> int:
    """Atomic number of an element symbol (any case) or a number given as text ("8")."""
    text = symbol.strip()
    if text.isdigit():
        z = int(text)
        if 1 <= z < len(ELEMENTS):
            return z
    elif text.upper() in _SYMBOL_TO_Z:
        return _SYMBOL_TO_Z[text.upper()]
    raise MoleculeError(f"unknown element {symbol!r}: use a symbol such as H, C, N, O or an atomic number")


def _parse_lines(lines: list[str], source: str) -> tuple[list[int], list[list[float]]]:
    numbers, coords = [], []
    for k, line in enumerate(lines, 1):
        parts = line.replace(",", " ").split()
        if not parts:
            continue
        if len(parts) != 4:
            raise MoleculeError(f"{source}, atom {k}: expected 'symbol x y z', got {line.strip()!r}")
        numbers.append(atomic_number(parts[0]))
        try:
            coords.append([float(x) for x in parts[1:]])
        except ValueError:
            raise MoleculeError(f"{source}, atom {k}: coordinates must be numbers, got {line.strip()!r}") from None
    return numbers, coords


def validate(molecule: Molecule) -> Molecule:
    """Check that ``molecule`` is something restricted Kohn-Sham can run; return it unchanged.

    Raises :class:`MoleculeError` for an empty molecule, non-finite coordinates, atoms closer than
    0.1 Angstrom, an odd electron count or a non-zero spin.
    """
    label = f" ({molecule.name})" if molecule.name else ""
    if molecule.natom == 0:
        raise MoleculeError(f"the molecule{label} has no atoms")
    pos = molecule.positions
    if pos.shape != (molecule.natom, 3):
        raise MoleculeError(f"positions{label} must have shape ({molecule.natom}, 3), got {pos.shape}")
    bad = ~np.isfinite(pos).all(axis=1)
    if bad.any():
        k = int(np.argmax(bad))
        raise MoleculeError(f"atom {k + 1} ({molecule.symbols[k]}){label} has a NaN or infinite coordinate")
    if molecule.natom > 1:
        dist = np.linalg.norm(pos[:, None, :] - pos[None, :, :], axis=-1)
        dist[np.diag_indices_from(dist)] = np.inf
        i, j = np.unravel_index(np.argmin(dist), dist.shape)
        d_ang = dist[i, j] / BOHR_PER_ANGSTROM
        if d_ang < MIN_DISTANCE_ANGSTROM:
            raise MoleculeError(
                f"atoms {min(i, j) + 1} and {max(i, j) + 1}{label} are {d_ang:.3g} Angstrom apart "
                f"(minimum {MIN_DISTANCE_ANGSTROM}): check the coordinates and their unit"
            )
    if molecule.spin != 0:
        raise MoleculeError(f"spin {molecule.spin}{label}: restricted Kohn-Sham needs a closed shell (spin 0)")
    if molecule.nelectron % 2:
        raise MoleculeError(
            f"{molecule.nelectron} electrons{label} (charge {molecule.charge}): restricted Kohn-Sham needs an "
            "even electron count; change the charge"
        )
    if molecule.nelectron <= 0:
        raise MoleculeError(f"{molecule.nelectron} electrons{label}: the charge leaves no electrons")
    return molecule


def from_atom_string(atoms: str, unit: str = "angstrom", charge: int = 0, spin: int = 0, name: str = "") -> Molecule:
    """Parse a PySCF-style atom string, ``"O 0 0 0; H 0 0.76 0.59"`` (atoms split by ';' or newlines)."""
    scale = _unit_scale(unit)
    lines = atoms.replace(";", "\n").splitlines()
    numbers, coords = _parse_lines(lines, "atom string")
    positions = np.array(coords, float).reshape(-1, 3) * scale
    return validate(Molecule(np.array(numbers, int), positions, charge, spin, name))


def from_name(name: str) -> Molecule:
    """One of the built-in molecules: see :data:`NAMED_MOLECULES`."""
    key = name.strip().lower()
    if key not in NAMED_MOLECULES:
        raise MoleculeError(f"unknown molecule name {name!r}: choose one of {', '.join(NAMED_MOLECULES)}")
    return from_atom_string(NAMED_MOLECULES[key], name=key)


def _unit_scale(unit: str) -> float:
    key = unit.strip().lower()
    if key in ("angstrom", "ang", "a"):
        return BOHR_PER_ANGSTROM
    if key in ("bohr", "au", "b"):
        return 1.0
    raise MoleculeError(f"unknown unit {unit!r}: use angstrom or bohr")
