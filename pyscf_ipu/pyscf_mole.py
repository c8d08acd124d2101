"""PySCF ``Mole`` objects for our molecules, with each element's parsed basis cached.

PySCF reads and parses a basis file for every molecule it builds; here each (basis, element) is
parsed once per process, which matters for a stream of conformers.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache

from pyscf import gto
from pyscf.lib.exceptions import BasisNotFoundError

from .molecule import Molecule, MoleculeError


@lru_cache(maxsize=None)
def element_basis(basis: str, symbol: str) -> list:
    """PySCF's parsed ``basis`` for one element (cached; treat as read-only). Raises as ``gto.basis.load``."""
    with warnings.catch_warnings():  # PySCF suggests basis-set-exchange on every miss
        warnings.simplefilter("ignore", UserWarning)
        return gto.basis.load(basis, symbol)


def check_basis(symbols, basis: str) -> dict[str, list]:
    """Each of ``symbols``'s parsed shells in ``basis``; an unknown basis, a missing element or one the
    basis gives an effective core potential is a MoleculeError."""
    shells, missing = {}, []
    for symbol in sorted(set(symbols)):
        try:
            shells[symbol] = element_basis(basis, symbol)
        except (BasisNotFoundError, KeyError, OSError, RuntimeError):
            missing.append(symbol)
    if missing and _basis_unknown(basis):
        raise MoleculeError(f"unknown basis {basis!r}: use a basis PySCF knows, such as sto-3g, 6-31g or def2-svp")
    if missing:
        raise MoleculeError(f"element(s) {', '.join(missing)} not in basis {basis!r}: choose another basis")
    cored = [symbol for symbol in shells if _needs_ecp(basis, symbol)]
    if cored:  # the basis describes valence electrons only; an all-electron run in it would be wrong
        raise MoleculeError(f"basis {basis!r} needs an effective core potential for {', '.join(cored)}, which this "
                            "package does not carry: choose an all-electron basis")  # fmt: skip
    return shells


@lru_cache(maxsize=None)
def _needs_ecp(basis: str, symbol: str) -> bool:
    """Whether PySCF pairs ``basis`` with an effective core potential for ``symbol`` (def2 from Rb on)."""
    with warnings.catch_warnings():  # PySCF suggests basis-set-exchange on every miss
        warnings.simplefilter("ignore", UserWarning)
        try:
            return bool(gto.basis.load_ecp(basis, symbol))
        except TypeError:  # an alias of several files (cc-pCVnZ, aug-cc-pVnZ-PP), which load_ecp cannot join
            files = gto.basis.ALIAS[gto.basis._format_basis_name(basis)]
            return any(_needs_ecp(os.path.join(os.path.dirname(gto.basis.__file__), f), symbol) for f in files)
        except (BasisNotFoundError, KeyError, OSError, RuntimeError):
            return False


def build_mole(molecule: Molecule, basis: str) -> gto.Mole:
    """A PySCF ``Mole`` for ``molecule`` in ``basis``; an unknown basis or a missing element is a MoleculeError."""
    shells = check_basis(molecule.symbols, basis)
    return gto.M(
        atom=molecule.pyscf_atom(),
        unit="Bohr",
        basis=shells,
        charge=molecule.charge,
        spin=molecule.spin,
        verbose=0,
    )


def _basis_unknown(basis: str) -> bool:
    """True if PySCF has no basis of this name at all (judged by hydrogen and carbon)."""
    for symbol in ("H", "C"):
        try:
            element_basis(basis, symbol)
            return False
        except (BasisNotFoundError, KeyError, OSError, RuntimeError):
            continue
    return True


def placeholder_mole(basis: str, elements: tuple[str, ...]) -> gto.Mole:
    """A Mole of ``elements`` in ``basis``, the atoms 3 Bohr apart on a line (geometry-independent uses)."""
    atoms = [(e, (0.0, 0.0, 3.0 * k)) for k, e in enumerate(elements)]
    shells = {e: element_basis(basis, e) for e in set(elements)}
    electrons = sum(gto.charge(e) for e in elements)
    return gto.M(atom=atoms, unit="Bohr", basis=shells, spin=electrons % 2, verbose=0)
