r"""Atomic-orbital values and gradients on grid points, in JAX.

A primitive Cartesian Gaussian :math:`g = x^i y^j z^l e^{-a r^2}` (coordinates relative to its
centre) has :math:`\partial g / \partial x = (i x^{i-1} - 2 a x^{i+1})\, y^j z^l e^{-a r^2}`, and
likewise in y and z. A contracted Cartesian AO shares its centre and powers among its primitives,
so the kernel sums the primitives' Gaussians into a radial part R and its slope first and applies
the polynomial once (:class:`AOTables` regroups :class:`~pyscf_ipu.integrals.basis.PrimitiveBasis`
so); d and f shells are then transformed to spherical AOs. The result is the (4, G, N) array of PySCF's
``eval_ao(mol, coords, deriv=1)``: values, then d/dx, d/dy, d/dz. A size bucket's conformers are
evaluated together on the device (:mod:`pyscf_ipu.assembly`).

Precision: a float32 position carries an absolute error of ~6e-7 Bohr at 10 Bohr from the origin,
while a core primitive (exponent 5,000) changes by 1e-4 relative over that distance near its
nucleus. So points are given as offsets from the atom whose Becke grid they belong to, and the
primitive centres relative to each atom are formed in float64: near a nucleus, the
displacement from it keeps full float32 relative precision (the test suite holds the float32
values within 3e-6 of PySCF's relative to max(1, |value|)).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .basis import MAX_L, PrimitiveBasis


@dataclass(frozen=True, eq=False)
class AOTables:
    """``PrimitiveBasis`` regrouped by Cartesian AO: each of the Nc Cartesian AOs as its K primitives
    (padded with zero coefficients), so that a kernel contracts the primitives of one AO with a sum
    over a short axis instead of a (P, Nc) matmul that is almost all zeros."""

    exponents: np.ndarray  # (Nc, K)
    coefficients: np.ndarray  # (Nc, K)  0 on padding
    powers: np.ndarray  # (Nc, 3) int
    atom: np.ndarray  # (Nc,) the atom each AO sits on
    cart2sph: np.ndarray | None  # (Nc, N), or None where it is the identity (s and p shells only)


def ao_tables(basis: PrimitiveBasis) -> AOTables:
    """:class:`AOTables` of ``basis`` (each primitive row of its contraction matrix has one entry)."""
    column = np.argmax(basis.contraction != 0, axis=1)  # (P,) the Cartesian AO of each primitive
    nc = basis.contraction.shape[1]
    counts = np.bincount(column, minlength=nc)
    k = int(counts.max())
    slot = np.zeros(len(column), int)
    for c in range(nc):
        slot[column == c] = np.arange(counts[c])
    exponents = np.ones((nc, k))
    coefficients = np.zeros((nc, k))
    exponents[column, slot] = basis.exponents
    coefficients[column, slot] = basis.contraction[np.arange(len(column)), column]
    powers, atom = np.zeros((nc, 3), np.int32), np.zeros(nc, np.int32)
    powers[column], atom[column] = basis.powers, basis.atom
    identity = basis.cart2sph.shape == (nc, nc) and np.array_equal(basis.cart2sph, np.eye(nc))
    return AOTables(exponents, coefficients, powers, atom, None if identity else basis.cart2sph)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AOConstants:
    """A basis's arrays as :func:`ao_kernel` takes them, for Nc Cartesian AOs of K primitives."""

    exponents: jax.Array  # (Nc, K)
    coefficients: jax.Array  # (Nc, K)
    derivative_coefficients: jax.Array  # (Nc, K)  -2 exponent x coefficient
    powers: jax.Array  # (Nc, 3) int
    cart2sph: jax.Array | None  # (Nc, N); None: the Cartesian AOs are the output

    def _cast(self, cast) -> AOConstants:
        """The float arrays through ``cast``, the powers as they are."""
        return AOConstants(cast(self.exponents), cast(self.coefficients), cast(self.derivative_coefficients),
                            self.powers, None if self.cart2sph is None else cast(self.cart2sph))  # fmt: skip


def constants(tables: AOTables) -> AOConstants:
    """The basis's arrays as the kernel takes them: exponents, coefficients, -2 exponent x
    coefficients, powers and the spherical transform (None where it is the identity)."""
    exponents, coefficients = tables.exponents, tables.coefficients
    return AOConstants(exponents, coefficients, -2.0 * exponents * coefficients, tables.powers, tables.cart2sph)


def ao_kernel(constants: AOConstants, offsets, shifts, owners, real):
    r"""(4, G, N) values and x/y/z gradients of one conformer at ``G`` points, each given as its offset
    (G, 3) from its owner atom ``owners`` (G,), with ``shifts`` (natm, Nc, 3) each atom's position
    minus each Cartesian AO's centre; ``real`` (G,) False for padding points, whose values are zero.

    Per Cartesian AO :math:`\phi = x^i y^j z^l R(r^2)` with the contracted radial part
    :math:`R = \sum_k c_k e^{-a_k r^2}` and :math:`R' = \sum_k (-2 a_k c_k) e^{-a_k r^2}`:
    :math:`\partial_x \phi = y^j z^l (i x^{i-1} R + x^{i+1} R')`, and likewise in y and z.

    Every array is (G, Nc), one per coordinate and per primitive: XLA's CPU code vectorises along
    the last axis only (``docs/decisions/ao-values-layout.md``).
    """
    exponents, coefficients, powers = constants.exponents, constants.coefficients, constants.powers
    derivative_coefficients, cart2sph = constants.derivative_coefficients, constants.cart2sph
    real = real[:, None]  # (G, 1)
    d = [offsets[:, k, None] + shifts[:, :, k][owners] for k in range(3)]  # (G, Nc) each: point minus AO centre
    r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2]
    radial = jnp.zeros_like(r2)
    slope = jnp.zeros_like(r2)  # dR/d(r^2) x 2
    for k in range(exponents.shape[1]):  # K primitives: a short, static loop
        gaussian = jnp.where(real, jnp.exp(-exponents[:, k] * r2), 0.0)
        radial = radial + coefficients[:, k] * gaussian
        slope = slope + derivative_coefficients[:, k] * gaussian
    # x^i and i x^(i-1) per axis by repeated products: powers are at most MAX_L
    monomial, lowered = [], []
    for axis in range(3):
        power, m, low = powers[:, axis], jnp.ones_like(r2), jnp.zeros_like(r2)
        for q in range(1, MAX_L + 1):
            low = jnp.where(power == q, q * m, low)  # m is x^(q-1) here
            m = jnp.where(power >= q, m * d[axis], m)
        monomial.append(m)
        lowered.append(low)
    x, y, z = monomial
    value = x * y * z * radial
    gradient = [y * z * (lowered[0] * radial + x * d[0] * slope),
                x * z * (lowered[1] * radial + y * d[1] * slope),
                x * y * (lowered[2] * radial + z * d[2] * slope)]  # fmt: skip
    out = jnp.stack([value, *gradient])  # (4, G, Nc)
    return out if cart2sph is None else out @ cart2sph


AO_BLOCK_VALUES = 1 << 21  # the most (point, Cartesian AO) values of each (G, Nc) temporary held at once


def ao_kernel_in_blocks(constants: AOConstants, offsets, shifts, owners, real, most_values: int = AO_BLOCK_VALUES):
    """:func:`ao_kernel`'s (4, G, N), a block of points at a time written into the one output array,
    where the whole grid's (G, Nc) temporaries would hold more than ``most_values`` values each: on a
    fine grid they and the Cartesian (4, G, Nc) stack would take twice the output's memory. A coarser
    grid goes in one block, since the loop over blocks runs slower. The block is the largest power of
    two that divides G (padded grids are multiples of 256) within ``most_values``."""
    points, cartesian = offsets.shape[0], constants.exponents.shape[0]
    if points * cartesian <= most_values:
        return ao_kernel(constants, offsets, shifts, owners, real)
    size = next(b for b in (1 << k for k in range(points.bit_length(), -1, -1))
                if points % b == 0 and (b * cartesian <= most_values or b == 1))  # fmt: skip
    n = cartesian if constants.cart2sph is None else constants.cart2sph.shape[1]

    def block(b, out):
        piece = [jax.lax.dynamic_slice_in_dim(a, b * size, size) for a in (offsets, owners, real)]
        return jax.lax.dynamic_update_slice_in_dim(out, ao_kernel(constants, piece[0], shifts, *piece[1:]), b * size, 1)

    return jax.lax.fori_loop(0, points // size, block, jnp.zeros((4, points, n), offsets.dtype))


def ao_values_at(basis: PrimitiveBasis, points, coords: jax.Array) -> jax.Array:
    """(4, G, N) at ``points`` (G, 3) for atom positions ``coords`` (natm, 3), a JAX array to
    differentiate; ``points`` a host array (the grid fixed in space) or JAX (moving with the atoms)."""
    dtype = coords.dtype
    tables = ao_tables(basis)
    centres = coords[jnp.asarray(tables.atom)]  # (Nc, 3)
    owners = jnp.zeros(len(points), jnp.int32)  # offsets from the origin: d = point - centre
    table = constants(tables)._cast(lambda a: jnp.asarray(a, dtype))
    return ao_kernel(table, jnp.asarray(points, dtype), -centres[None], owners, jnp.ones(len(points), bool))
