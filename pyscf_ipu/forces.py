r"""Nuclear gradients dE/dR of a converged RKS (or HF) energy, by ``jax.grad`` through the JAX integrals.

At self-consistency the energy is stationary in the orbitals under the orthonormality constraint,
so its total derivative with respect to a nuclear coordinate is the partial derivative of the
Lagrangian at fixed density D and energy-weighted density W (Pople et al., Int. J. Quantum Chem.
Symp. 13, 225 (1979); Helgaker, Jorgensen and Olsen, 13.6):

.. math::

    \frac{dE}{dR} = \frac{\partial}{\partial R}\Big[\operatorname{tr} D h(R)
        + \tfrac12 \sum D_{\mu\nu} D_{\lambda\sigma} (\mu\nu|\lambda\sigma)(R)
        - \tfrac{a_x}{4} \sum D_{\mu\lambda} D_{\nu\sigma} (\mu\nu|\lambda\sigma)(R)
        + E_{xc}[\rho_R] + V_{NN}(R) - \operatorname{tr} W S(R)\Big],

with D = 2 C_occ C_occ^T and W = 2 C_occ diag(eps_occ) C_occ^T from the converged orbitals. The
function in brackets is written in JAX on the JAX integrals (:mod:`pyscf_ipu.integrals`, float64)
and differentiated by ``jax.grad``; nothing is differentiated through the SCF iterations.

By default the quadrature grid is held fixed in space (points and weights), as PySCF's default RKS
gradient does (``grid_response=False``): the result is comparable with
``mf.nuc_grad_method().kernel()``, and a finite-difference check must keep the grid fixed too.
With ``grid_response=True`` the grid moves with the atoms (:mod:`pyscf_ipu.grid`, PySCF's grid
definition in JAX): comparable with PySCF's ``grid_response = True`` and with plain finite
differences of the energy. tests/test_forces.py checks both.

The two-electron part is a dot product of the s8 ERIs with a host vector: each unique integral
(u) = (mu nu|lambda sigma) stands for m_u index tuples (its distinct permutations), so its
coefficient is m_u D_mu,nu D_lambda,sigma / 2 - a_x m_u (D_mu,lambda D_nu,sigma +
D_mu,sigma D_nu,lambda) / 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .packed import degeneracy_weights, tril_unpack
from .grid import atom_grids, grid_coords_and_weights
from .integral_sources import eri_plan
from .molecule import Molecule
from .pyscf_mole import build_mole
from .integrals.ao_values import ao_values_at
from .integrals.basis import primitive_basis
from .integrals.eri import eri_s8
from .integrals.one_electron import one_electron_at
from .numint import xc_energy
from .results import SCFResult
from .xc.functionals import Functional


def two_electron_coefficients(dm: np.ndarray, exchange: float) -> np.ndarray:
    """(size,) float64: d E_2e / d (u) for every s8-packed ERI u, at the density ``dm`` (N, N)."""
    npair = dm.shape[0] * (dm.shape[0] + 1) // 2
    ij, kl = tril_unpack(np.arange(npair * (npair + 1) // 2))  # packed quartet u -> (ij, kl), ij >= kl
    (p, q), (r, s) = tril_unpack(ij), tril_unpack(kl)
    multiplicity = 8.0 * degeneracy_weights(np.stack([p, q, r, s], axis=1))  # distinct permutations of u
    coulomb = 0.5 * dm[p, q] * dm[r, s]
    exact = 0.125 * exchange * (dm[p, r] * dm[q, s] + dm[p, s] * dm[q, r])
    return multiplicity * (coulomb - exact)


def nuclear_gradient(molecule: Molecule, result: SCFResult, functional: Functional, grid_response: bool = False
                     ) -> np.ndarray:  # fmt: skip
    """(natm, 3) dE/dR in Hartree/Bohr of ``molecule`` at ``result``'s converged orbitals.

    ``grid_response=False`` holds the grid (PySCF's at ``molecule``) fixed in space (PySCF's default
    gradient); True moves the points and Becke weights with the atoms (:mod:`pyscf_ipu.grid`), as
    PySCF's ``grid_response = True`` does: the exact derivative of the energy as the SCF computes it.
    """
    mol = build_mole(molecule, result.config.basis)
    nocc = molecule.nelectron // 2
    occupied = result.mo_coeff[:, :nocc]  # (N, nocc)
    dm = 2.0 * occupied @ occupied.T
    weighted = 2.0 * (occupied * result.mo_energy[:nocc]) @ occupied.T
    basis = primitive_basis(mol)
    plan = eri_plan(result.config.basis, tuple(mol.elements))
    coefficients = two_electron_coefficients(dm, functional.hf_exchange)
    charges = mol.atom_charges().astype(np.float64)
    on_grid = bool(result.grid_points) and bool(functional.pieces)
    moving = atom_grids(mol, result.config.grid_level) if grid_response and on_grid else None
    fixed = None if grid_response or not on_grid else _grid(mol, result.config.grid_level)
    with jax.enable_x64(True):
        dm_, weighted_, coefficients_ = (jnp.asarray(a) for a in (dm, weighted, coefficients))
        charges_ = jnp.asarray(charges)
        pairs = np.triu_indices(mol.natm, 1)

        def energy(coords):
            ints = one_electron_at(basis, coords)
            total = jnp.sum(dm_ * (ints["kinetic"] + ints["nuclear"])) - jnp.sum(weighted_ * ints["overlap"])
            total += jnp.dot(coefficients_, eri_s8(plan, coords[None], jnp.float64)[0])
            if on_grid:
                if moving is None:
                    points, weights = fixed[0], jnp.asarray(fixed[1])
                else:
                    points, weights = grid_coords_and_weights(moving, coords)
                total += xc_energy(functional, ao_values_at(basis, points, coords), weights, dm_)
            distance = jnp.linalg.norm(coords[pairs[0]] - coords[pairs[1]], axis=-1)
            return total + jnp.sum(charges_[pairs[0]] * charges_[pairs[1]] / distance)

        return np.asarray(jax.grad(energy)(jnp.asarray(mol.atom_coords())))


def _grid(mol, level: int) -> tuple[np.ndarray, np.ndarray]:
    """PySCF's RKS grid of ``mol`` at ``level`` (points (G, 3), weights (G,)), unsorted, unpadded: the
    loop's quadrature."""
    from pyscf import dft

    grids = dft.gen_grid.Grids(mol)
    grids.level = level
    grids.build(with_non0tab=False, sort_grids=False)
    return grids.coords, grids.weights
