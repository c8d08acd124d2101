r"""Numerical integration of the exchange-correlation energy on the grid.

.. math::

    \rho(r) = \sum_{\mu\nu} D_{\mu\nu} \phi_\mu(r) \phi_\nu(r), \qquad
    \nabla\rho = 2 \sum_{\mu\nu} D_{\mu\nu} \phi_\mu \nabla\phi_\nu, \qquad
    E_{xc}[D] = \sum_g w_g\, e_{xc}(\rho_g, |\nabla\rho_g|^2)

The potential matrix is the derivative of the energy with respect to the density matrix,
:math:`V^{xc}_{\mu\nu} = \partial E_{xc} / \partial D_{\mu\nu}`, taken by ``jax.grad`` (and
symmetrised, since only symmetric variations of D are physical). This gives the usual LDA/GGA
potential matrix without writing its formula out twice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .xc.functionals import Functional


def density(ao: jnp.ndarray, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """rho (G,) and sigma = |grad rho|^2 (G,) from AO values/gradients ``ao`` (4, G, N) and ``dm`` (N, N)."""
    half = ao[0] @ dm  # (G, N)  sum_mu phi_mu D_mu,nu
    rho = jnp.sum(half * ao[0], axis=-1)
    grad = 2.0 * jnp.einsum("xgn,gn->xg", ao[1:4], half)  # (3, G)
    return rho, jnp.sum(grad * grad, axis=0)


def xc_energy(functional: Functional, ao, weights, dm) -> jnp.ndarray:
    """E_xc[D] (a scalar) by quadrature on the grid."""
    rho, sigma = density(ao, dm)
    return jnp.sum(weights * functional.energy_density(rho, sigma))


def xc_energy_and_potential(functional: Functional, ao, weights, dm) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(E_xc, V_xc) with V_xc = dE_xc/dD (N, N), symmetrised."""
    if not functional.pieces:  # Hartree-Fock: no grid work at all
        return jnp.zeros((), dm.dtype), jnp.zeros_like(dm)
    exc, grad = jax.value_and_grad(lambda d: xc_energy(functional, ao, weights, d))(dm)
    return exc, 0.5 * (grad + grad.T)


def electron_count(ao, weights, dm) -> jnp.ndarray:
    """The integral of rho on the grid: a free check of the grid and of D (should be the electron count)."""
    return jnp.sum(weights * density(ao, dm)[0])
