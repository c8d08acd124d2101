r"""Atomic-orbital values and gradients on grid points, in JAX.

A primitive Cartesian Gaussian :math:`g = x^i y^j z^l e^{-a r^2}` (coordinates relative to its
centre) has :math:`\partial g / \partial x = (i x^{i-1} - 2 a x^{i+1})\, y^j z^l e^{-a r^2}`, and
likewise in y and z. The primitives' values are contracted to Cartesian AOs and transformed to
spherical ones with the matrices of :class:`~pyscf_ipu.integrals.basis.PrimitiveBasis`, giving the
(4, G, N) array of PySCF's ``eval_ao(mol, coords, deriv=1)``: values, then d/dx, d/dy, d/dz.

Precision: a float32 position carries an absolute error of ~6e-7 Bohr at 10 Bohr from the origin,
while a core primitive (exponent 5,000) changes by 1e-4 relative over that distance near its
nucleus. So points are given as offsets from the atom whose Becke grid they belong to, and the
primitive centres relative to each atom are formed in float64 on the host: near a nucleus, the
displacement from it keeps full float32 relative precision. Measured on whole level-0 grids, error
relative to max(1, |value|): water 6-31G* 1.2e-5 from absolute positions (an O 1s gradient), 6.5e-7
this way; benzene STO-3G 1.3e-6, QM9 21989 6-31G* 1.5e-6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .basis import PrimitiveBasis


def ao_values(basis: PrimitiveBasis, coords: np.ndarray, owners: np.ndarray, dtype=jnp.float32) -> jax.Array:
    """(4, G, N): AO values and gradients at ``coords`` (G, 3) Bohr, in ``dtype`` (jit-compiled per shape).

    ``owners`` (G,): the atom whose grid each point belongs to (PySCF's ``grids.atm_idx``; any atom,
    e.g. the nearest, serves; negative entries, PySCF's padding, are taken as atom 0).
    """
    owners = np.maximum(np.asarray(owners), 0)
    offsets = np.asarray(coords, np.float64) - basis.coords[owners]  # (G, 3), float64 on the host
    shifts = basis.coords[:, None, :] - basis.centres[None, :, :]  # (natm, P, 3): atom minus primitive centre
    floats = (jnp.asarray(a, dtype) for a in (basis.exponents, basis.contraction, basis.cart2sph, offsets, shifts))
    exponents, contraction, cart2sph, offsets, shifts = floats
    return _ao_values(exponents, jnp.asarray(basis.powers), contraction, cart2sph, offsets, jnp.asarray(owners), shifts)


@jax.jit
def _ao_values(exponents, powers, contraction, cart2sph, offsets, owners, shifts):
    d = offsets[:, None, :] + shifts[owners]  # (G, P, 3): point minus primitive centre
    radial = jnp.exp(-exponents * jnp.sum(d * d, axis=-1))  # (G, P)
    n = powers.astype(d.dtype)  # (P, 3)
    monomial = jnp.power(d, powers)  # (G, P, 3): x^i, y^j, z^l (0^0 = 1)
    lowered = jnp.where(powers > 0, n * jnp.power(d, jnp.maximum(powers - 1, 0)), 0.0)  # i x^(i-1)
    derivative = lowered - 2.0 * exponents[:, None] * monomial * d  # (G, P, 3): d/dx of x^i e^(-a x^2), per axis
    value = jnp.prod(monomial, axis=-1) * radial  # (G, P)
    gradient = [derivative[..., k] * jnp.prod(jnp.delete(monomial, k, axis=-1, assume_unique_indices=True), axis=-1)
                * radial for k in range(3)]  # fmt: skip
    primitives = jnp.stack([value, *gradient])  # (4, G, P)
    return primitives @ (contraction @ cart2sph)  # (4, G, N)


def ao_values_at(basis: PrimitiveBasis, points, coords: jax.Array) -> jax.Array:
    """(4, G, N) at ``points`` (G, 3) for atom positions ``coords`` (natm, 3), a JAX array to
    differentiate; ``points`` a host array (the grid fixed in space) or JAX (moving with the atoms)."""
    dtype = coords.dtype
    exponents, contraction, cart2sph = (jnp.asarray(a, dtype) for a in (basis.exponents, basis.contraction, basis.cart2sph))
    centres = coords[jnp.asarray(basis.atom)]  # (P, 3)
    owners = jnp.zeros(len(points), jnp.int32)  # offsets from the origin: d = point - centre
    return _ao_values(exponents, jnp.asarray(basis.powers), contraction, cart2sph, jnp.asarray(points, dtype), owners,
                      -centres[None])  # fmt: skip
