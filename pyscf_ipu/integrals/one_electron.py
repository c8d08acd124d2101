r"""Overlap, kinetic-energy and nuclear-attraction matrices by McMurchie-Davidson, in JAX.

With the Hermite expansion coefficients E^{ij}_t of a primitive pair per axis (:mod:`.hermite`;
T. Helgaker, P. Jorgensen, J. Olsen, *Molecular Electronic-Structure Theory*, Wiley 2000, 9.5),
the overlap per axis is S_ij = E^{ij}_0 sqrt(pi/p); the kinetic energy (with the other two axes'
overlaps) takes the symmetric form T = 1/2 <grad a|grad b>, whose 1-D terms
D_ij = ij S_{i-1,j-1} - 2aj S_{i+1,j-1} - 2bi S_{i-1,j+1} + 4ab S_{i+1,j+1} do not cancel for a
tight and a diffuse primitive on one atom, as the textbook -2b^2 S_{i,j+2} + b(2j+1) S_ij - ... does
(that would cost float32 a factor p/a ~ 1e4 in relative precision); and the nuclear attraction to a
charge Z at C is

.. math::

    V = -Z \frac{2\pi}{p} \sum_{tuv} E^{ij}_t E^{kl}_u E^{mn}_v R_{tuv}(p, R_{PC}),

with the Hermite Coulomb integrals R of :mod:`.hermite`.

Every primitive pair (alpha <= beta: the matrices are symmetric) is computed at once (arrays over
pairs, the recursions unrolled at trace time up to the basis's highest l), then contracted to
Cartesian AOs and transformed to spherical ones. The nuclei enter as W_tuv = sum_C Z_C R_tuv, summed
once per distinct pair of (atom, exponent) and contracted with the E's once (see
:func:`_nuclear_hermite`), not per nucleus and Cartesian pair. In float64 the
result equals libcint's ``int1e_ovlp``, ``int1e_kin`` and ``int1e_nuc`` to ~1e-13. The one-centre
parts (both primitives on one atom: their overlap, kinetic energy and attraction to that atom's
nucleus) do not depend on the geometry and are the largest elements, so they come from libcint in
float64 (:func:`.basis.one_centre_one_electron`) and the kernel computes the rest; the sum over
nuclei is Kahan-compensated, so the float32 matrices meet the bounds of ``docs/science.md``.
Geometry enters through differences (A - B, and A - C from the host in float64), so a pair of
primitives on one atom sees exactly zero displacement (forming P and then P - A in float32 would
lose relative precision on core-valence elements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .basis import PrimitiveBasis
from .hermite import PairFactors, hermite_coefficients, hermite_coulomb, hermite_indices


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OneElectronLayout:
    """What the kernel reads of a basis besides its values: the same for every molecule of a size
    bucket's template (:mod:`pyscf_ipu.templates`), whichever elements fill its slots. ``lmax`` is
    static (the Hermite tables' size)."""

    columns: np.ndarray  # (P,) int: each primitive's Cartesian AO
    cart2sph: np.ndarray  # (Nc, N)
    powers: np.ndarray  # (P, 3) int
    atom: np.ndarray  # (P,) int
    sites: np.ndarray  # (S,) int: a representative primitive of each (atom, exponent)
    site_pair_of_row: np.ndarray  # (M,) int
    rows: np.ndarray  # (2, M): primitive pairs alpha <= beta (the matrices are symmetric)
    site_pairs: np.ndarray  # (2, Ms): pairs of sites s <= t
    lmax: int = field(metadata=dict(static=True))


def layout_of(basis: PrimitiveBasis) -> OneElectronLayout:
    """The :class:`OneElectronLayout` of ``basis`` (the sites from its exponents: which primitives of an
    atom share one; the same for every element of a kind, see :func:`~pyscf_ipu.buckets.element_kind`)."""
    pairs = _pairs(basis.atom, basis.exponents)
    return OneElectronLayout(
        columns=np.argmax(basis.contraction != 0, axis=1).astype(np.int32),
        cart2sph=basis.cart2sph,
        powers=basis.powers,
        atom=basis.atom,
        sites=pairs.sites,
        site_pair_of_row=pairs.site_pair_of_row,
        rows=pairs.rows,
        site_pairs=pairs.site_pairs,
        lmax=int(basis.powers.sum(axis=1).max()),
    )


def coefficients_of(basis: PrimitiveBasis) -> np.ndarray:
    """(P,) each primitive's coefficient in its Cartesian AO (the one entry of its contraction row)."""
    columns = np.argmax(basis.contraction != 0, axis=1)
    return basis.contraction[np.arange(len(columns)), columns]


def one_electron_matrices(layout: OneElectronLayout, exponents, coefficients, charges, one_centre, coords
                          ) -> dict[str, jax.Array]:  # fmt: skip
    """{"overlap", "kinetic", "nuclear"}: (N, N) spherical AO matrices of one conformer, in the
    precision of ``coords`` (natm, 3) Bohr, from the basis's values: ``exponents`` and
    ``coefficients`` (P,) of the primitives, nuclear ``charges`` (natm,) and the one-centre
    integrals ``one_centre`` (3, N, N) (see :class:`~.basis.PrimitiveBasis`). Traced; the primitive
    centres' displacements from the nuclei are formed here, in the positions' precision."""
    dtype = coords.dtype
    centres = coords[layout.atom]  # (P, 3)
    contraction = jnp.zeros((len(layout.columns), layout.cart2sph.shape[0]), dtype)
    contraction = contraction.at[jnp.arange(len(layout.columns)), layout.columns].set(coefficients.astype(dtype))
    basis = _KernelBasis(exponents=exponents.astype(dtype), contraction=contraction,
                         cart2sph=jnp.asarray(layout.cart2sph, dtype), charges=charges.astype(dtype),
                         one_centre=one_centre.astype(dtype), powers=layout.powers, atom=layout.atom,
                         sites=layout.sites, site_pair_of_row=layout.site_pair_of_row, centres=centres,
                         centre_shifts=centres[None, :, :] - coords[:, None, :])  # fmt: skip
    return _one_electron(basis, layout.rows, layout.site_pairs, layout.lmax)


def one_electron_at(basis: PrimitiveBasis, coords: jax.Array) -> dict[str, jax.Array]:
    """:func:`one_electron_matrices` of ``basis`` at the atom positions ``coords`` (natm, 3), a JAX
    array to differentiate."""
    return one_electron_matrices(layout_of(basis), jnp.asarray(basis.exponents), jnp.asarray(coefficients_of(basis)),
                                 jnp.asarray(basis.charges), jnp.asarray(basis.one_centre), coords)  # fmt: skip


class _Pairs(NamedTuple):
    """Host index arrays of the kernel: which primitive pairs it computes."""

    rows: np.ndarray  # (2, M): primitive pairs alpha <= beta (the matrices are symmetric)
    sites: np.ndarray  # (S,): a representative primitive of each distinct (atom, exponent)
    site_pairs: np.ndarray  # (2, Ms): pairs of sites s <= t
    site_pair_of_row: np.ndarray  # (M,): the site pair of each primitive pair


def _pairs(atom: np.ndarray, exponents: np.ndarray) -> _Pairs:
    """The nuclear attraction's Hermite integrals R depend on a primitive pair only through its
    exponents and centres, which the Cartesian components of a shell (and, in Pople bases, the s and
    p shells of an sp set) share: they are computed once per distinct pair of (atom, exponent)."""
    keys = np.stack([atom.astype(np.float64), exponents], 1)
    _, sites, site_of = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    site_of = site_of.reshape(-1)
    rows = np.stack(np.triu_indices(len(exponents)))
    site_pairs = np.stack(np.triu_indices(len(sites)))
    lookup = np.zeros((len(sites), len(sites)), np.int64)
    lookup[site_pairs[0], site_pairs[1]] = np.arange(site_pairs.shape[1])
    first, second = np.sort(site_of[rows], axis=0)
    return _Pairs(rows.astype(np.int32), sites.astype(np.int32), site_pairs.astype(np.int32),
                  lookup[first, second].astype(np.int32))  # fmt: skip


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _KernelBasis:
    """A conformer's basis and positions as the kernel reads them: P primitives, C Cartesian
    functions, N AOs, A nuclei, S sites."""

    exponents: jax.Array  # (P,)
    contraction: jax.Array  # (P, C)
    cart2sph: jax.Array  # (C, N)
    charges: jax.Array  # (A,)
    one_centre: jax.Array  # (3, N, N)  overlap, kinetic and own-nucleus attraction of one-atom pairs
    powers: jax.Array  # (P, 3) int
    atom: jax.Array  # (P,) int
    sites: jax.Array  # (S,) int  a representative primitive of each (atom, exponent) site
    site_pair_of_row: jax.Array  # (M,) int  each primitive pair's site pair
    centres: jax.Array  # (P, 3)
    centre_shifts: jax.Array  # (A, P, 3)  A - C of each nucleus C and primitive centre A


def _select(table, i, j, t: int):
    """``table[i[m]][j[m]][t][m]`` (M,) of the nested tables of :func:`hermite_coefficients` (zero
    where t > i + j), with indices i, j (M,), by masks: indexing a stacked table with them would be
    a gather, which XLA's CPU backend runs as scalar code."""
    out = jnp.zeros_like(table[0][0][0])
    for a, row in enumerate(table):
        for b, entry in enumerate(row):
            if t < len(entry):
                out = jnp.where((i == a) & (j == b), entry[t], out)
    return out


def _one_electron(basis: _KernelBasis, rows, site_pairs, lmax: int) -> dict[str, jax.Array]:
    """Overlap, kinetic and nuclear-attraction matrices (N', N') of one conformer's ``basis``, over the
    primitive pairs ``rows`` (2, M) and site pairs ``site_pairs`` (2, Ms), Hermite tables to ``lmax``."""
    exponents, centres, powers, contraction, cart2sph = (basis.exponents, basis.centres, basis.powers,
                                                          basis.contraction, basis.cart2sph)  # fmt: skip
    atom, one_centre, site_pair_of_row = basis.atom, basis.one_centre, basis.site_pair_of_row
    dtype = exponents.dtype
    n = exponents.shape[0]  # primitives
    alpha, beta = rows  # (M,) each
    a, b, ca, cb, la, lb = exponents[alpha], exponents[beta], centres[alpha], centres[beta], powers[alpha], powers[beta]
    p = a + b
    factors = PairFactors.of(a, b)
    overlap_1d, kinetic_1d, e_nuc = [], [], []
    for axis in range(3):
        # i and j up to l + 1: the gradients raise each side by one; t up to 2 lmax for the nuclei.
        table = hermite_coefficients(lmax + 1, lmax + 1, factors, ca[:, axis] - cb[:, axis])
        i, j = la[:, axis], lb[:, axis]
        root = jnp.sqrt(math.pi / p)

        def s(di, dj):
            return _select(table, jnp.maximum(i + di, 0), jnp.maximum(j + dj, 0), 0) * root

        fi, fj = i.astype(dtype), j.astype(dtype)
        gradient = fi * fj * s(-1, -1) - 2.0 * a * fj * s(1, -1) - 2.0 * b * fi * s(-1, 1) + 4.0 * a * b * s(1, 1)
        overlap_1d.append(s(0, 0))
        kinetic_1d.append(0.5 * gradient)
        e_nuc.append([_select(table, i, j, t) for t in range(2 * lmax + 1)])  # (M,) each
    sx, sy, sz = overlap_1d
    tx, ty, tz = kinetic_1d
    # pairs on one atom: their overlap, kinetic energy and own-nucleus attraction are ``one_centre``
    one_atom = atom[alpha] == atom[beta]
    overlap = jnp.where(one_atom, 0.0, sx * sy * sz)
    kinetic = jnp.where(one_atom, 0.0, tx * sy * sz + sx * ty * sz + sx * sy * tz)
    w = _nuclear_hermite(exponents, centres, basis.charges, basis.centre_shifts, atom, basis.sites, site_pairs, 2 * lmax)
    ex, ey, ez = e_nuc
    nuclear = -(2.0 * math.pi / p) * sum(ex[t] * ey[u] * ez[v] * w[k][site_pair_of_row]
                                          for k, (t, u, v) in enumerate(hermite_indices(2 * lmax)))  # fmt: skip

    def spherical(values):  # (M,) primitive pair values -> (N, N) spherical AOs
        # the symmetric (P, P) matrix from its upper triangle: the diagonal halved, plus the transpose
        upper = jnp.zeros((n, n), dtype).at[alpha, beta].set(jnp.where(alpha == beta, 0.5, 1.0) * values)
        cart = contraction.T @ (upper + upper.T) @ contraction
        return cart2sph.T @ cart @ cart2sph

    return {"overlap": spherical(overlap) + one_centre[0], "kinetic": spherical(kinetic) + one_centre[1],
            "nuclear": spherical(nuclear) + one_centre[2]}  # fmt: skip


def _nuclear_hermite(exponents, centres, charges, centre_shifts, atom, sites, site_pairs, order: int):
    """W_tuv = sum_C Z_C R_tuv(p, P - C), (K, Ms) for the (t, u, v) of :func:`hermite_indices` and
    every site pair, the sum leaving out a pair's own nucleus when both primitives sit on it (that
    attraction is in ``one_centre``). The nuclear attraction of a primitive pair is then
    -(2 pi / p) sum_tuv E_t E_u E_v W_tuv: the E contraction runs once, not once per nucleus.

    P - C = (A - C) + (P - A), with A - C from the host's float64 table ``centre_shifts`` and
    P - A = -(b/p)(A - B): both exact for a pair on the nucleus itself.
    """
    first, second = sites[site_pairs[0]], sites[site_pairs[1]]  # (Ms,) representative primitives
    a, b = exponents[first], exponents[second]
    p = a + b
    pa = -(b / p)[:, None] * (centres[first] - centres[second])  # (Ms, 3)
    own = jnp.where(atom[first] == atom[second], atom[first], -1)  # (Ms,) the shared atom, or -1
    indices = hermite_indices(order)

    def one_nucleus(carry, nucleus):
        total, compensation = carry  # (K, Ms) each
        z, shifts, index = nucleus  # shifts (P, 3): primitive centres minus this nucleus
        r = hermite_coulomb(order, p, jnp.moveaxis(shifts[first] + pa, -1, 0))
        term = jnp.where(own == index, 0.0, z) * jnp.stack([r[key] for key in indices])
        # Kahan summation over the nuclei: ~20 terms of a few Hartree each would otherwise lose
        # ~1e-6 to float32 rounding of the running sum
        corrected = term - compensation
        new = total + corrected
        return (new, (new - total) - corrected), None

    nuclei = jnp.arange(charges.shape[0])
    zero = jnp.zeros((len(indices), p.shape[0]), p.dtype)
    (total, _), _ = jax.lax.scan(one_nucleus, (zero, zero), (charges, centre_shifts, nuclei))
    return total
