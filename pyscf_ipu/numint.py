r"""Numerical integration of the exchange-correlation energy on the grid.

.. math::

    \rho(r) = \sum_{\mu\nu} D_{\mu\nu} \phi_\mu(r) \phi_\nu(r), \qquad
    \nabla\rho = 2 \sum_{\mu\nu} D_{\mu\nu} \phi_\mu \nabla\phi_\nu, \qquad
    E_{xc}[D] = \sum_g w_g\, e_{xc}(\rho_g, |\nabla\rho_g|^2)

The potential matrix is the derivative of the energy with respect to the density matrix,
:math:`V^{xc}_{\mu\nu} = \partial E_{xc} / \partial D_{\mu\nu}`, taken by ``jax.grad`` (and
symmetrised, since only symmetric variations of D are physical). This gives the usual LDA/GGA
potential matrix without writing its formula out twice.

The grid is processed in blocks of :func:`grid_block` points, one after another in a
``lax.fori_loop``: each block's four (B, N) AO arrays stay in cache while the density, the functional
and the potential are computed from them, where passes over the whole grid would each stream the
full AO array from memory. The alternatives measured and rejected (whole-grid products, XLA's
backend flags, two loops, AO screening per block) are in ``docs/decisions/xc-grid-blocks.md``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from .xc.functionals import Functional


def density(ao: jnp.ndarray, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """rho (G,) and sigma = |grad rho|^2 (G,) from AO values/gradients ``ao`` (4, G, N), or the four
    (G, N) arrays as a sequence, and ``dm`` (N, N)."""
    half = ao[0] @ dm  # (G, N)  sum_mu phi_mu D_mu,nu
    # four row-wise dot products, one per AO array, as batched dot_generals: XLA's CPU code for a
    # product and a row sum ran 2-3 times as long, and the one (3, G, N) -> (3, G) einsum is slower
    rho, gx, gy, gz = (jnp.einsum("gn,gn->g", half, ao[k]) for k in range(4))
    return rho, 4.0 * (gx * gx + gy * gy + gz * gz)  # |2 sum_nu D phi grad phi|^2


def xc_energy(functional: Functional, ao, weights, dm) -> jnp.ndarray:
    """E_xc[D] (a scalar) by quadrature on the grid."""
    return _xc_energy_and_electrons(functional, ao, weights, dm)[0]


def _xc_energy_and_electrons(functional: Functional, ao, weights, dm) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(E_xc[D], the integral of rho) by quadrature on the grid, from one evaluation of the density."""
    rho, sigma = density(ao, dm)
    return jnp.sum(weights * functional.energy_density(rho, sigma)), jnp.sum(weights * rho)


def grid_block(points: int) -> int:
    """Points per block: 1024 or the largest power of two below it that divides ``points``; padded
    grids (multiples of 256, see ``padding.padded_size``) get at least 256. Larger blocks stop fitting
    in cache, smaller ones pay more loop overhead."""
    for size in (1024, 512, 256, 128, 64, 32, 16, 8):
        if points % size == 0:
            return size
    return points


def weighted_points(weights) -> jax.Array:
    """(): one past the last point of non-zero weight in ``weights`` (G,), in the default integer type
    (block offsets are formed from it). A size bucket pads a molecule's grid at its end with
    zero-weight points; the XC loop stops before them."""
    index = jnp.arange(1, weights.shape[-1] + 1)
    return jnp.max(jnp.where(weights != 0, index, 0), axis=-1, initial=0)  # 0 without a grid (Hartree-Fock)


def xc_energy_and_potential(functional: Functional, ao, weights, dm, points) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(E_xc, V_xc, electrons): V_xc = dE_xc/dD (N, N), symmetrised, and the integral of rho on the
    grid (a free check of the grid and of D: it should be the electron count; NaN without a grid).
    The grid in blocks (see the module doc); the electron count comes from each block's own rho,
    which spares a second pass over the AO values.

    ``points`` (a scalar, possibly traced; ``len(weights)`` for all): the points after it have zero weight, so
    only the blocks up to it are evaluated. A vmapped batch passes one unbatched value for all its
    members (their largest :func:`weighted_points`): the loop's trip count and block offsets then
    stay scalars, where a per-member count would turn every block's slices into gathers.
    """
    if not functional.pieces:  # Hartree-Fock: no grid work at all
        return jnp.zeros((), dm.dtype), jnp.zeros_like(dm), jnp.full((), jnp.nan, dm.dtype)
    size = grid_block(weights.shape[0])
    blocks = weights.shape[0] // size
    blocks = jnp.minimum((points + size - 1) // size, blocks)
    n = ao.shape[-1]

    def block(b, total):
        # four (B, N) blocks, one per AO array, each sliced out on its own: sliced as one (4, B, N)
        # block, each array's block would be copied out of it again for the matmuls that read it
        # (vmapped over a batch, its rows are not contiguous).
        # AO values stored in a lower precision than dm (the float64 finalisation reads the float32
        # loop's) are promoted block by block.
        ao_b = [jax.lax.dynamic_slice(ao, (k, b * size, 0), (1, size, n))[0].astype(dm.dtype) for k in range(4)]
        w_b = jax.lax.dynamic_slice_in_dim(weights, b * size, size)  # (B,)
        energy = partial(_xc_energy_and_electrons, functional, ao_b, w_b)
        (exc, electrons), grad = jax.value_and_grad(energy, has_aux=True)(dm)
        return total[0] + exc, total[1] + grad, total[2] + electrons

    zero = jnp.zeros((), dm.dtype)
    exc, grad, electrons = jax.lax.fori_loop(0, blocks, block, (zero, jnp.zeros_like(dm), zero))
    return exc, 0.5 * (grad + grad.T), electrons
