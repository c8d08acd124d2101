"""Integral sources: where a batch's one-electron integrals, ERIs and grid come from.

Two strategies behind one interface (:class:`IntegralSource`), registered by name in
:data:`INTEGRAL_SOURCES` (``RKSConfig.integrals``; :func:`pyscf_ipu.method.resolve` picks one):
:class:`LibcintIntegrals` (PySCF's libcint on the host, float64: the reference) and
:class:`JaxIntegrals` (the JAX kernels of :mod:`pyscf_ipu.integrals`, one program per stage for a
whole batch of conformers). Both take the conformers of one size bucket as PySCF ``Mole`` objects;
the geometry-independent parts (ERI plans, primitive bases, AO tables, atom grids) are cached per
(basis, elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from pyscf import gto

from .buckets import SizeBucket, pad_atoms
from .config import RKSConfig
from .integrals.ao_values import AOTables, ao_tables
from .pyscf_mole import placeholder_mole
from .packed import s8_size
from .programs import compiled, precision_scope, usable_cores


def screened(mol: gto.Mole, expcutoff: float) -> gto.Mole:
    """A copy of ``mol`` whose libcint integrals use primitive screening at ``expcutoff``.

    libcint skips a primitive product (and so a primitive quartet or triple) whose Gaussian prefactor
    bound, times the contraction coefficients, is below exp(-expcutoff); 0 keeps its default of 60.
    The default of 30 changes no label measurably (``docs/decisions/libcint-expcutoff.md``).
    """
    copy = mol.copy()
    copy._env[gto.PTR_EXPCUTOFF] = expcutoff
    return copy


def eri_s8(mol: gto.Mole, expcutoff: float = 0.0) -> np.ndarray:
    """The 8-fold-symmetric ERI from libcint, with its primitive screening at ``expcutoff``
    (:func:`screened`). ``mol`` itself is left unchanged."""
    return screened(mol, expcutoff).intor("int2e", aosym="s8")


def fitted_eri(mol: gto.Mole, basis: str, expcutoff: float = 0.0) -> np.ndarray:
    """(naux, npair) float64: the density-fitted ERIs as a Cholesky factor B with
    (ij|kl) ~ sum_Q B[Q, ij] B[Q, kl], over pairs i >= j in PySCF's packing, in the fitting basis of
    :func:`~pyscf_ipu.buckets.auxiliary_basis` (PySCF's default for ``basis``): B = L^-1 (Q|ij) with
    L the Cholesky factor of the metric (P|Q), as ``df.incore.cholesky_eri`` makes it.

    The 3-centre integrals come from libcint in one call, with its primitive screening at
    ``expcutoff`` (:func:`screened`), and are solved in place, with BLAS on every
    core this process may use (the rest of the run keeps one BLAS thread): one thread would leave
    the others idle through the solve. A metric that is not positive definite goes to PySCF's
    function, which drops its near-null directions. ``mol`` itself is left unchanged.
    """
    import scipy.linalg
    from pyscf import df
    from threadpoolctl import threadpool_limits

    from .buckets import auxiliary_basis

    auxmol = df.addons.make_auxmol(mol, {symbol: auxiliary_basis(basis, symbol) for symbol in set(mol.elements)})
    orbitals = screened(mol, expcutoff)  # the 3-centre integrals read it from the orbital basis's part
    try:
        metric = scipy.linalg.cholesky(auxmol.intor("int2c2e", hermi=1), lower=True)  # (naux, naux) L
    except scipy.linalg.LinAlgError:
        return df.incore.cholesky_eri(orbitals, auxmol=auxmol)
    ints = df.incore.aux_e2(orbitals, auxmol, "int3c2e", aosym="s2ij")  # (npair, naux), Fortran order
    trsm = scipy.linalg.get_blas_funcs("trsm", (metric, ints))
    with threadpool_limits(usable_cores(), user_api="blas"):
        # X L^T = (ij|Q): X = B^T, written over the integrals
        factor_t = trsm(1.0, metric, ints, side=1, lower=True, trans_a=1, overwrite_b=True)
    return factor_t.T


def libcint_one_electron(mols: list[gto.Mole]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(overlap, core Hamiltonian) of each conformer in ``mols``, float64 from libcint."""
    return [(mol.intor("int1e_ovlp"), mol.intor("int1e_kin") + mol.intor("int1e_nuc")) for mol in mols]


def libcint_fitted_eris(mols: list[gto.Mole], bucket: SizeBucket, config: RKSConfig) -> list[np.ndarray]:
    """:func:`fitted_eri` of each conformer in ``mols``, screened at ``config.eri_expcutoff``."""
    return [fitted_eri(mol, bucket.basis, config.eri_expcutoff) for mol in mols]


def device_one_electron(mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray]]:
    """(overlap, core Hamiltonian) of each conformer in ``mols`` (molecules of ``bucket``), as float64
    host arrays at the molecules' sizes, from :mod:`pyscf_ipu.integrals` in one call.

    Computed in float64 whatever the SCF's precision: in float32 their errors are systematic, and the
    labels' energy is first order in them; they are a small part of the work.
    """
    from .integrals.one_electron import one_electron

    bases = [primitive_template(bucket.basis, tuple(mol.elements)) for mol in mols]
    capacity = primitive_template(bucket.basis, bucket.template_elements)
    with precision_scope("float64"):
        ints = one_electron(bases, conformer_coords(mols, bucket), np.dtype("float64"), capacity)
        overlap, hcore = np.asarray(ints["overlap"]), np.asarray(ints["kinetic"]) + np.asarray(ints["nuclear"])
    return [(overlap[k, : mol.nao, : mol.nao], hcore[k, : mol.nao, : mol.nao]) for k, mol in enumerate(mols)]


def device_eri_s8(mols: list[gto.Mole], bucket: SizeBucket, precision: str) -> tuple[list[np.ndarray], list[int]]:
    """(s8 ERIs, their non-zero counts) of each conformer in ``mols`` (molecules of ``bucket``) from
    :mod:`pyscf_ipu.integrals.eri`, computed in ``precision`` as one batch and kept in it: each the
    bucket's s8 array (the molecule's is its leading part, the rest zero), a read-only numpy view of
    the device's buffer (no copy on a CPU), which the J-K layout stacks as it is. The finalisation
    contracts these on the device. The counts are taken on the device too, where they are cheap."""
    from .integrals.eri import eri_s8 as device_eris

    plans = [eri_plan(bucket.basis, tuple(mol.elements), bucket) for mol in mols]
    with precision_scope(precision):
        eris = device_eris(plans, conformer_coords(mols, bucket), precision)
        counts = np.asarray(_count_nonzero(eris))
        eris = np.asarray(eris)
    return list(eris), [int(c) for c in counts]


@compiled
def _count_nonzero(eris: jax.Array) -> jax.Array:
    """(C,) non-zero entries of each s8 array, int32 (an s8 array has fewer than 2^31 entries)."""
    return jnp.count_nonzero(eris, axis=-1)


def conformer_coords(mols: list[gto.Mole], bucket: SizeBucket) -> np.ndarray:
    """(C, natm, 3) Bohr: the conformers' positions, padded to the bucket's atoms with dummies."""
    return np.stack([pad_atoms(mol.atom_coords(), bucket.natm) for mol in mols])


@lru_cache(maxsize=64)
def eri_plan(basis: str, elements: tuple[str, ...], bucket: SizeBucket | None = None):
    """The ERI plan of ``basis`` on these atoms in this order, in the shapes of ``bucket`` (default:
    its own bucketed counts); it does not depend on the geometry."""
    from .integrals.eri_plan import plan_eri

    return plan_eri(placeholder_mole(basis, elements), None if bucket is None else eri_capacity(bucket))


@lru_cache(maxsize=16)
def eri_capacity(bucket: SizeBucket):
    """The ERI shapes of ``bucket`` (:func:`~.integrals.eri_plan.eri_capacity` of its template molecule)."""
    from .integrals.eri_plan import eri_capacity as capacity

    return capacity(placeholder_mole(bucket.basis, bucket.template_elements))


@lru_cache(maxsize=64)
def primitive_template(basis: str, elements: tuple[str, ...]):
    """The :class:`~.integrals.basis.PrimitiveBasis` of ``basis`` on these atoms, at placeholder
    positions: everything in it but ``coords`` is geometry independent (its one-centre integrals
    come from libcint, once per (basis, elements))."""
    from .integrals.basis import primitive_basis

    return primitive_basis(placeholder_mole(basis, elements))


@lru_cache(maxsize=64)
def ao_template(basis: str, elements: tuple[str, ...]) -> AOTables:
    """The :class:`~.integrals.ao_values.AOTables` of ``basis`` on these atoms (geometry independent)."""
    return ao_tables(primitive_template(basis, elements))


@lru_cache(maxsize=64)
def _atom_grids(elements: tuple[str, ...], bucket: SizeBucket):
    """The atoms' grids of a molecule (geometry independent), padded to its bucket's points and
    atoms (zero-volume points, dummy atoms), and the molecule's own point count."""
    from .grid import atom_grids, pad_grids

    grids = atom_grids(placeholder_mole(bucket.basis, elements), bucket.grid_level)
    return pad_grids(grids, bucket.grid_points, bucket.natm), len(grids.volumes)


def device_grids(mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(points (G, 3), weights (G,), owners (G,)) of each conformer in ``mols`` (molecules of
    ``bucket``), in float64, from one device program: the points and weights of PySCF's grid at the
    bucket's level without its zero-weight alignment padding (equal to PySCF's to 1e-12)."""
    from .grid import grid_program

    grids = [_atom_grids(tuple(mol.elements), bucket) for mol in mols]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[g for g, _ in grids])
    with jax.enable_x64(True):
        points, weights = grid_program(stacked, conformer_coords(mols, bucket))
        points, weights = np.asarray(points), np.asarray(weights)
    return [(points[k, :count], weights[k, :count], g.owner[:count]) for k, (g, count) in enumerate(grids)]


class IntegralSource(Protocol):
    """Where a batch's integrals and grid come from: one object per source, chosen by name
    (``RKSConfig.integrals``, resolved by :func:`pyscf_ipu.method.resolve`). Every method takes the
    conformers of one size bucket as PySCF ``Mole`` objects."""

    name: str

    def one_electron(self, mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple[np.ndarray, np.ndarray]]:
        """(overlap, core Hamiltonian) of each conformer, float64 at the molecule's size."""

    def eris(self, mols: list[gto.Mole], bucket: SizeBucket,
             config: RKSConfig) -> tuple[list[np.ndarray], list[int]]:  # fmt: skip
        """The s8 ERIs of each conformer and their non-zero counts."""

    def fitted_eris(self, mols: list[gto.Mole], bucket: SizeBucket, config: RKSConfig) -> list[np.ndarray]:
        """The density-fitted ERIs of each conformer (:func:`fitted_eri`), for a density-fitted J-K backend."""

    def grids(self, mols: list[gto.Mole], bucket: SizeBucket) -> list[tuple | None]:
        """Each conformer's (points, weights, owners), whose AO values the device then evaluates;
        None: PySCF builds the grid and evaluates the AO values on the host."""

    exact_on_device: bool
    """Whether the loop's integrals are as exact as any the host holds, so that the float64
    finalisation contracts them on the device; else it contracts the host's float64 ERIs."""

    def eri_plan(self, basis: str, elements: tuple[str, ...]):
        """The ERI plan that spreads the integrals over tiles (for the IPU profile), or None."""

    def held_bytes(self, nao: int, grid_points: int, value_bytes: int) -> dict[str, int]:
        """What one conformer's preparation holds on the host: {"eris": bytes, "ao_values": bytes}
        for ``nao`` AOs and ``grid_points`` points, the loop in ``value_bytes`` floats."""


@dataclass(frozen=True)
class LibcintIntegrals:
    """libcint through PySCF, in float64 on the host: the reference. A float32 loop holds these
    integrals rounded, so the finalisation contracts the host's float64 ERIs instead."""

    name: str = "libcint"

    def one_electron(self, mols, bucket):
        return libcint_one_electron(mols)

    def eris(self, mols, bucket, config):
        eris = [eri_s8(mol, config.eri_expcutoff) for mol in mols]
        return eris, [int(np.count_nonzero(eri)) for eri in eris]

    def fitted_eris(self, mols, bucket, config):
        return libcint_fitted_eris(mols, bucket, config)

    def grids(self, mols, bucket):
        return [None] * len(mols)

    exact_on_device: bool = False

    def eri_plan(self, basis, elements):
        return None

    def held_bytes(self, nao, grid_points, value_bytes):
        # float64, kept for the finalisation; AO values evaluated by PySCF on the host
        return {"eris": 8 * s8_size(nao), "ao_values": 8 * 4 * grid_points * nao}


@dataclass(frozen=True)
class JaxIntegrals:
    """The JAX kernels of :mod:`pyscf_ipu.integrals`, one program per stage for a whole batch: the
    one-electron integrals in float64, the ERIs in the SCF's precision, the grid and (later) the AO
    values. The loop's J-K arrays then hold the very integrals the host would use, so the device
    contracts them for the finalisation too (in float64).

    Where JAX runs on the CPU, the one-electron integrals come from libcint instead: the device is
    then this host, where libcint computes them faster than the device program runs, with no
    program to compile or load (``docs/decisions/one-electron-on-a-cpu.md``); both are float64."""

    name: str = "jax"

    def one_electron(self, mols, bucket):
        if jax.default_backend() == "cpu":
            return libcint_one_electron(mols)
        return device_one_electron(mols, bucket)

    def eris(self, mols, bucket, config):
        return device_eri_s8(mols, bucket, config.precision)

    def fitted_eris(self, mols, bucket, config):
        # libcint's 3-centre integrals: a fitted run has no N^4 work left for the device kernels to take
        return libcint_fitted_eris(mols, bucket, config)

    def grids(self, mols, bucket):
        return device_grids(mols, bucket)

    exact_on_device: bool = True

    def eri_plan(self, basis, elements):
        return eri_plan(basis, tuple(elements))

    def held_bytes(self, nao, grid_points, value_bytes):
        # the bucket's s8 array in the loop's precision; the AO values never leave the device
        return {"eris": value_bytes * s8_size(nao), "ao_values": 0}


INTEGRAL_SOURCES: dict[str, IntegralSource] = {source.name: source for source in (LibcintIntegrals(), JaxIntegrals())}
