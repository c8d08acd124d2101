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

The two-electron part depends on the J-K backend, since each differentiates the energy it computed:

- **Exact ERIs**: a dot product of the s8 ERIs with a host vector: each unique integral
  (u) = (mu nu|lambda sigma) stands for m_u index tuples (its distinct permutations), so its
  coefficient is m_u D_mu,nu D_lambda,sigma / 2 - a_x m_u (D_mu,lambda D_nu,sigma +
  D_mu,sigma D_nu,lambda) / 8.
- **Density fitting** (``--jk df``), with 3-centre integrals T_P,ij = (ij|P), metric M = (P|Q),
  c = M^-1 T D (the fitted density) and X_P = C_occ^T (M^-1 T)_P C_occ:

  .. math::

      \frac{dE_2}{dR} = \sum_{P,ij} T^R_{P,ij}\big[c_P D_{ij} - 2 a_x (C X_P C^T)_{ij}\big]
          + \sum_{PQ} M^R_{PQ}\big[-\tfrac12 c_P c_Q + a_x \operatorname{tr} X_P X_Q\big]

  (Weigend, Haser, Patzelt and Ahlrichs, Chem. Phys. Lett. 294, 143 (1998)). The brackets are
  computed once from libcint's integrals at the geometry (float64, as the CPU's SCF fits with), and
  contract libcint's derivative integrals (``int3c2e_ip1``, ``int3c2e_ip2``, ``int2c2e_ip1``) a block
  of fitting functions at a time. (``jax.grad`` through the JAX fitting kernels instead compiled for
  minutes per molecule: ``docs/decisions/fitted-forces.md``.)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .buckets import auxiliary_basis
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
    The two-electron part is the derivative of what ``result``'s J-K backend computed: the exact
    ERIs', or the density-fitted ones' (``result.config.density_fitted``).
    """
    mol = build_mole(molecule, result.config.basis)
    nocc = molecule.nelectron // 2
    occupied = result.mo_coeff[:, :nocc]  # (N, nocc)
    dm = 2.0 * occupied @ occupied.T
    weighted = 2.0 * (occupied * result.mo_energy[:nocc]) @ occupied.T
    basis = primitive_basis(mol)
    charges = mol.atom_charges().astype(np.float64)
    on_grid = bool(result.grid_points) and bool(functional.pieces)
    moving = atom_grids(mol, result.config.grid_level) if grid_response and on_grid else None
    fixed = None if grid_response or not on_grid else _grid(mol, result.config.grid_level)
    coords = mol.atom_coords()
    with jax.enable_x64(True):
        charges_ = jnp.asarray(charges)
        pairs = np.triu_indices(mol.natm, 1)

        def energy(coords, dm, weighted, fixed):  # everything but the two-electron energy
            ints = one_electron_at(basis, coords)
            total = jnp.sum(dm * (ints["kinetic"] + ints["nuclear"])) - jnp.sum(weighted * ints["overlap"])
            if on_grid:
                points, weights = fixed if moving is None else grid_coords_and_weights(moving, coords)
                total += xc_energy(functional, ao_values_at(basis, points, coords), weights, dm)
            distance = jnp.linalg.norm(coords[pairs[0]] - coords[pairs[1]], axis=-1)
            return total + jnp.sum(charges_[pairs[0]] * charges_[pairs[1]] / distance)

        # one program: op by op, the gradient of the AO values on the grid is slower than
        # compiling it and running it (RESULTS.md); what changes with the geometry is an argument, so
        # that a molecule's other conformers find the program in the compilation cache
        gradient = jax.jit(jax.grad(energy))(*(jnp.asarray(a) for a in (coords, dm, weighted)), fixed)
        two_electron = fitted_two_electron_gradient if result.config.density_fitted else exact_two_electron_gradient
        return np.asarray(gradient) + two_electron(mol, result.config.basis, occupied, functional.hf_exchange)


def exact_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float) -> np.ndarray:
    """(natm, 3) the exact-ERI two-electron energy's derivative at the density of ``occupied`` (N, nocc):
    ``jax.grad`` of the s8 ERIs' dot product with :func:`two_electron_coefficients`."""
    plan = eri_plan(basis, tuple(mol.elements))
    with jax.enable_x64(True):
        coefficients = jnp.asarray(two_electron_coefficients(2.0 * occupied @ occupied.T, exchange))
        gradient = jax.grad(lambda coords: jnp.dot(coefficients, eri_s8(plan, coords[None], jnp.float64)[0]))
        return np.asarray(gradient(jnp.asarray(mol.atom_coords())))


def fitted_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float) -> np.ndarray:
    """(natm, 3) the density-fitted two-electron energy's derivative at the density of ``occupied``
    (N, nocc), with PySCF's default fitting basis (what ``--jk df`` fits with): libcint's 3-centre
    integrals and metric at the geometry give the weights (:func:`fitted_weights`), which then
    contract libcint's derivative integrals, a block of fitting shells at a time (module docstring)."""
    from pyscf import df

    auxmol = df.addons.make_auxmol(mol, {s: auxiliary_basis(basis, s) for s in set(mol.elements)})
    three = df.incore.aux_e2(mol, auxmol, intor="int3c2e", aosym="s2ij")  # (npair, Q)
    metric = auxmol.intor("int2c2e")
    with jax.enable_x64(True):
        three_weights, metric_weights = fitted_weights(three.T, metric, occupied, exchange)
        three_weights, metric_weights = np.asarray(three_weights), np.asarray(metric_weights)
    del three
    n = mol.nao
    i, j = np.tril_indices(n)
    by_ao = np.zeros((3, n))  # sum over j, P of (nabla i j|P) G_P,ij
    by_aux = np.zeros((3, auxmol.nao))  # sum over ij of (ij|nabla P) G_P,ij
    offsets = auxmol.ao_loc_nr()
    for first, last in _shell_blocks(offsets, FITTED_BLOCK_FUNCTIONS):
        p0, p1 = offsets[first], offsets[last]
        weights = np.zeros((p1 - p0, n, n))  # the full G_P for the block's functions
        half = three_weights[p0:p1] / np.where(i == j, 1.0, 2.0)  # a packed pair's weight covers ij and ji
        weights[:, i, j] = half
        weights[:, j, i] = half
        slices = (0, mol.nbas, 0, mol.nbas, first, last)
        bra = df.incore.aux_e2(mol, auxmol, intor="int3c2e_ip1", aosym="s1", comp=3, shls_slice=slices)  # (3, N, N, b)
        by_ao += np.einsum("xijp,pij->xi", bra, weights, optimize=True)
        del bra
        ket = df.incore.aux_e2(mol, auxmol, intor="int3c2e_ip2", aosym="s1", comp=3, shls_slice=slices)
        by_aux[:, p0:p1] = np.einsum("xijp,pij->xp", ket, weights, optimize=True)
        del ket
    metric_derivative = auxmol.intor("int2c2e_ip1", comp=3)  # (3, Q, Q): (nabla P|Q)
    by_aux += 2.0 * np.einsum("xpq,pq->xp", metric_derivative, metric_weights)
    # d/dR_A of a function on A is minus its gradient in the electron's coordinate; i and j alike
    gradient = np.zeros((mol.natm, 3))
    np.add.at(gradient, _function_atoms(mol), -2.0 * by_ao.T)
    np.add.at(gradient, _function_atoms(auxmol), -by_aux.T)
    return gradient


def _function_atoms(mol) -> np.ndarray:
    """(nao,) the atom of each of ``mol``'s basis functions."""
    slices = mol.aoslice_by_atom()  # (natm, 4): shells, then functions, [first, last)
    return np.repeat(np.arange(mol.natm), slices[:, 3] - slices[:, 2])


FITTED_BLOCK_FUNCTIONS = 256  # fitting functions whose derivative integrals (3 N^2 each) are held at once


def _shell_blocks(offsets: np.ndarray, most: int) -> list[tuple[int, int]]:
    """Consecutive shell ranges [first, last) of at most ``most`` functions each (one shell at least),
    from the shells' function offsets (S + 1,)."""
    blocks, first = [], 0
    for last in range(1, len(offsets)):
        if offsets[last] - offsets[first] > most and last - 1 > first:
            blocks.append((first, last - 1))
            first = last - 1
    blocks.append((first, len(offsets) - 1))
    return blocks


FITTED_BLOCK = 64  # fitting functions whose (N, N) matrices the weights unpack at once


@partial(jax.jit, static_argnums=3)
def fitted_weights(three, metric, occupied, exchange: float):
    """The brackets of the module docstring as weights of the 3-centre integrals packed over pairs i >= j
    (Q, npair), as libcint's ``s2ij`` packs them (a pair i > j stands for ij and ji), and of the metric
    (Q, Q), from the integrals ``three`` and ``metric`` at the geometry and the occupied orbitals (N, nocc).

    The exchange term needs X_P = C^T (M^-1 T)_P C = sum_Q (M^-1)_PQ C^T T_Q C: it is formed from the
    small C^T T_Q C, so that M^-1 T, as large as T, is never made."""
    n, nocc = occupied.shape
    i, j = np.tril_indices(n)
    scale = jnp.asarray(np.where(i == j, 1.0, 2.0))  # (npair,)
    dm = 2.0 * occupied @ occupied.T
    lower = jnp.linalg.cholesky(metric)
    density = dm[i, j] * scale
    fitted = jax.scipy.linalg.cho_solve((lower, True), three @ density)  # (Qp,)  c = M^-1 T D
    three_weights = fitted[:, None] * density[None, :]
    metric_weights = -0.5 * jnp.outer(fitted, fitted)
    if not exchange:
        return three_weights, metric_weights
    naux = three.shape[0]
    blocks = -(-naux // FITTED_BLOCK)
    padded = jnp.pad(three, [(0, blocks * FITTED_BLOCK - naux), (0, 0)]).reshape(blocks, FITTED_BLOCK, -1)

    def unpack(rows):  # (b, npair) -> (b, N, N)
        return jnp.zeros((rows.shape[0], n, n), rows.dtype).at[:, i, j].set(rows).at[:, j, i].set(rows)

    def project(rows):  # C^T T_Q C per fitting function Q of the block: (b, nocc, nocc)
        return jnp.einsum("ia,qij,jb->qab", occupied, unpack(rows), occupied)

    projected = jax.lax.map(project, padded).reshape(-1, nocc * nocc)[:naux]
    x = jax.scipy.linalg.cho_solve((lower, True), projected)  # (Qp, nocc^2)  X_P = sum_Q (M^-1)_PQ C^T T_Q C
    xb = jnp.pad(x, [(0, blocks * FITTED_BLOCK - naux), (0, 0)]).reshape(blocks, FITTED_BLOCK, nocc, nocc)

    def back(block):  # C X_P C^T, packed: (b, npair)
        return jnp.einsum("ia,qab,jb->qij", occupied, block, occupied)[:, i, j]

    exchange_weights = jax.lax.map(back, xb).reshape(-1, len(i))[:naux]
    return three_weights - 2.0 * exchange * exchange_weights * scale, metric_weights + exchange * x @ x.T


def _grid(mol, level: int) -> tuple[np.ndarray, np.ndarray]:
    """PySCF's RKS grid of ``mol`` at ``level`` (points (G, 3), weights (G,)), unsorted, unpadded: the
    loop's quadrature."""
    from pyscf import dft

    grids = dft.gen_grid.Grids(mol)
    grids.level = level
    grids.build(with_non0tab=False, sort_grids=False)
    return grids.coords, grids.weights
