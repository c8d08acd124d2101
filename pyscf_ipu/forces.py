r"""Nuclear gradients dE/dR of a converged RKS (or HF) energy: analytic, from the converged orbitals.

At self-consistency the energy is stationary in the orbitals under the orthonormality constraint,
so its total derivative with respect to a nuclear coordinate is the partial derivative of the
Lagrangian at fixed density D and energy-weighted density W (Pople et al., Int. J. Quantum Chem.
Symp. 13, 225 (1979); Helgaker, Jorgensen and Olsen, 13.6):

.. math::

    \frac{dE}{dR} = \frac{\partial}{\partial R}\Big[\operatorname{tr} D h(R)
        + \tfrac12 \sum D_{\mu\nu} D_{\lambda\sigma} (\mu\nu|\lambda\sigma)(R)
        - \tfrac{a_x}{4} \sum D_{\mu\lambda} D_{\nu\sigma} (\mu\nu|\lambda\sigma)(R)
        + E_{xc}[\rho_R] + V_{NN}(R) - \operatorname{tr} W S(R)\Big],

with D = 2 C_occ C_occ^T and W = 2 C_occ diag(eps_occ) C_occ^T from the converged orbitals; nothing
is differentiated through the SCF iterations. All in float64:

- the one-electron terms from libcint's derivative integrals (:func:`one_electron_gradient`);
- E_xc and V_NN by ``jax.grad`` through the JAX AO values (:mod:`pyscf_ipu.integrals`) and grid, one
  compiled program per molecule composition (:class:`Composition`);
- the two-electron terms as below.

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
  contract libcint's derivative integrals (``int3c2e_ip1``, ``int2c2e_ip1``) a block of fitting
  functions at a time; the derivative on the fitting function follows from translation invariance.
  (``jax.grad`` through the JAX fitting kernels instead compiled for minutes per molecule:
  ``docs/decisions/fitted-forces.md``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .buckets import auxiliary_basis
from .packed import degeneracy_weights, tril_unpack
from .prepare import screened
from .programs import MappingBudget, compiled, usable_cores
from .grid import AtomGrids, atom_grids, grid_coords_and_weights
from .integral_sources import eri_plan
from .molecule import Molecule
from .pyscf_mole import build_mole
from .integrals.ao_values import ao_values_at
from .integrals.basis import PrimitiveBasis, primitive_basis
from .integrals.eri import eri_s8
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
    config, exchange = result.config, functional.hf_exchange
    composition = Composition.of(mol, config.basis, config.grid_level, bool(result.grid_points) and bool(
        functional.pieces), grid_response)  # fmt: skip
    fixed = _grid(mol, config.grid_level) if composition.on_grid and not grid_response else ()
    with jax.enable_x64(True):
        # dispatched first: on an accelerator it runs while the host computes the integrals' part
        gradient = grid_and_nuclei_gradient(composition, functional, mol.atom_coords(), dm, fixed)
        one_electron = one_electron_gradient(mol, dm, weighted)
        if config.density_fitted:
            two_electron = fitted_two_electron_gradient(mol, config.basis, occupied, exchange, config.eri_expcutoff)
        else:
            two_electron = exact_two_electron_gradient(mol, config.basis, occupied, exchange)
        return np.asarray(gradient) + one_electron + two_electron


def one_electron_gradient(mol, dm: np.ndarray, weighted: np.ndarray) -> np.ndarray:
    """(natm, 3) the derivative of tr D (T + V) - tr W S at fixed D and W (N, N), from libcint's
    derivative integrals in float64.

    libcint's ``int1e_ip*`` give (nabla mu|O|nu), the derivative in the bra function's electron
    coordinate, which is minus the derivative in its centre; with D and W symmetric, the functions on
    atom A contribute -2 sum_(mu on A) [(nabla mu|T + V|nu) D - (nabla mu|nu) W]. The attraction to
    nucleus A moves with A as well: integrating by parts, d/dR_A (mu|-Z_A/r_A|nu) =
    -Z_A [(nabla mu|1/r_A|nu) + (mu|1/r_A|nabla nu)] (``int1e_iprinv`` about A)."""
    operators = mol.intor("int1e_ipkin", comp=3) + mol.intor("int1e_ipnuc", comp=3)  # (3, N, N)
    by_function = np.einsum("xij,ij->ix", operators, dm) - np.einsum("xij,ij->ix", mol.intor("int1e_ipovlp", comp=3),
                                                                       weighted)  # (N, 3)  # fmt: skip
    gradient = np.zeros((mol.natm, 3))
    np.add.at(gradient, _function_atoms(mol), -2.0 * by_function)
    for atom, charge in enumerate(mol.atom_charges()):
        with mol.with_rinv_at_nucleus(atom):
            gradient[atom] -= 2.0 * charge * np.einsum("xij,ij->x", mol.intor("int1e_iprinv", comp=3), dm)
    return gradient


@dataclass(frozen=True)
class Composition:
    """What the XC and nuclear-repulsion gradient's program is built from beyond its arguments: the
    basis's primitive arrays and the atomic grids, which follow from the molecule's
    composition alone. It is named and compared by that composition (``name``), so that one program
    serves every conformer of a molecule, in this process and, from the program directory, in later
    ones (:func:`~pyscf_ipu.programs.compiled`)."""

    name: tuple  # (basis, elements, grid level, on a grid, grid moving, PySCF's version)
    basis: PrimitiveBasis = field(compare=False, repr=False)
    atoms: AtomGrids = field(compare=False, repr=False)

    @property
    def on_grid(self) -> bool:
        return self.name[3]

    @property
    def grid_response(self) -> bool:
        return self.name[4]

    @classmethod
    def of(cls, mol, basis: str, grid_level: int, on_grid: bool, grid_response: bool) -> Composition:
        import pyscf

        name = (basis, tuple(mol.elements), grid_level, on_grid, on_grid and grid_response, pyscf.__version__)
        return cls(name, primitive_basis(mol), atom_grids(mol, grid_level))


def _grid_and_nuclei_energy(composition: Composition, functional: Functional, coords, dm, fixed):
    """E_xc plus the nuclear repulsion at the atom positions ``coords`` (natm, 3), with the density
    ``dm`` (N, N) held fixed, and the grid ``fixed`` ((G, 3) points, (G,) weights) or moving with the
    atoms (``composition.grid_response``)."""
    basis = composition.basis
    total = jnp.zeros((), coords.dtype)
    if composition.on_grid:
        points, weights = grid_coords_and_weights(composition.atoms, coords) if composition.grid_response else fixed
        total += _xc_energy_in_blocks(functional, basis, jnp.asarray(points), jnp.asarray(weights), coords, dm)
    first, second = np.triu_indices(len(basis.charges), 1)
    charges = jnp.asarray(basis.charges)
    distance = jnp.linalg.norm(coords[first] - coords[second], axis=-1)
    return total + jnp.sum(charges[first] * charges[second] / distance)


FORCES_GRID_BLOCK = 2048  # grid points whose AO values (and their derivatives) the gradient holds at once


def _xc_energy_in_blocks(functional: Functional, basis: PrimitiveBasis, points, weights, coords, dm):
    """E_xc as a sum over blocks of :data:`FORCES_GRID_BLOCK` points (G, 3), (G,), each block's AO
    values recomputed in the gradient's backward pass (``jax.checkpoint``) rather than stored: the
    gradient then holds one block's AO values and their derivatives, not the whole grid's. The last
    block is filled with copies of the last point at zero weight."""
    count = -(-len(weights) // FORCES_GRID_BLOCK)
    pad = count * FORCES_GRID_BLOCK - len(weights)
    points = jnp.concatenate([points, jnp.broadcast_to(points[-1], (pad, 3))]).reshape(count, -1, 3)
    weights = jnp.pad(weights, (0, pad)).reshape(count, -1)

    @jax.checkpoint
    def block(total, chunk):
        where, weight = chunk
        return total + xc_energy(functional, ao_values_at(basis, where, coords), weight, dm), None

    return jax.lax.scan(block, jnp.zeros((), coords.dtype), (points, weights))[0]


@compiled(static_argnums=(0, 1), budget=MappingBudget())
def grid_and_nuclei_gradient(composition: Composition, functional: Functional, coords, dm, fixed):
    """(natm, 3) the gradient of :func:`_grid_and_nuclei_energy` in ``coords``, as one program: op by
    op, the gradient of the AO values on the grid is slower than compiling it and running it."""
    return jax.grad(_grid_and_nuclei_energy, argnums=2)(composition, functional, coords, dm, fixed)


def exact_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float) -> np.ndarray:
    """(natm, 3) the exact-ERI two-electron energy's derivative at the density of ``occupied`` (N, nocc):
    ``jax.grad`` of the s8 ERIs' dot product with :func:`two_electron_coefficients`."""
    plan = eri_plan(basis, tuple(mol.elements))
    with jax.enable_x64(True):
        coefficients = jnp.asarray(two_electron_coefficients(2.0 * occupied @ occupied.T, exchange))
        gradient = jax.grad(lambda coords: jnp.dot(coefficients, eri_s8(plan, coords[None], jnp.float64)[0]))
        return np.asarray(gradient(jnp.asarray(mol.atom_coords())))


def fitted_two_electron_gradient(mol, basis: str, occupied: np.ndarray, exchange: float, expcutoff: float = 0.0
                                 ) -> np.ndarray:  # fmt: skip
    """(natm, 3) the density-fitted two-electron energy's derivative at the density of ``occupied``
    (N, nocc), with PySCF's default fitting basis (what ``--jk df`` fits with), from libcint's integrals
    with the SCF's primitive screening ``expcutoff`` (:func:`~pyscf_ipu.prepare.screened`).

    The fitted density and the exchange intermediates (:func:`fitted_intermediates`) give each fitting
    function P its weight matrix G_P = c_P D - 2 a_x C X_P C^T; G contracts the derivative integrals
    (nabla i j|P) a block of fitting shells at a time. The derivative on the fitting function comes from
    the same integrals: translation of all three centres together leaves (ij|P) unchanged, so
    (ij|nabla P) = -(nabla i j|P) - (i nabla j|P), and with G_P symmetric its sum is -2 sum_ij
    (nabla i j|P) G_P,ij. BLAS runs on every core this process may use, as in the SCF's fitting.
    """
    from pyscf import df
    from threadpoolctl import threadpool_limits

    auxmol = df.addons.make_auxmol(mol, {s: auxiliary_basis(basis, s) for s in set(mol.elements)})
    orbitals = screened(mol, expcutoff)
    n = len(occupied)
    dm = 2.0 * occupied @ occupied.T  # (N, N)
    by_ao = np.zeros((3, n))  # sum over j, P of (nabla i j|P) G_P,ij
    by_aux = np.zeros((3, auxmol.nao))  # sum over ij of (ij|nabla P) G_P,ij
    offsets = auxmol.ao_loc_nr()
    with threadpool_limits(usable_cores(), user_api="blas"):
        three = df.incore.aux_e2(orbitals, auxmol, intor="int3c2e", aosym="s2ij")  # (npair, Q), Fortran order
        fitted, x = fitted_intermediates(three, auxmol.intor("int2c2e"), occupied, dm, exchange)
        del three
        for first, last in _shell_blocks(offsets, FITTED_BLOCK_FUNCTIONS):
            p0, p1 = offsets[first], offsets[last]
            weights = _weights(fitted[p0:p1], x[p0:p1], occupied, dm, exchange)  # (b, N, N) G_P, symmetric
            slices = (0, mol.nbas, 0, mol.nbas, first, last)
            bra = df.incore.aux_e2(orbitals, auxmol, intor="int3c2e_ip1", aosym="s1", comp=3, shls_slice=slices)
            bra = bra.transpose(0, 3, 2, 1)  # (3, b, N, N): (nabla i j|P) at [x, P, j, i], contiguous
            by_ao += np.einsum("xpji,pji->xi", bra, weights)
            by_aux[:, p0:p1] = -2.0 * np.einsum("xpji,pji->xp", bra, weights)
            del bra, weights
        metric_weights = -0.5 * np.outer(fitted, fitted)  # (Q, Q)
        if exchange:
            flat = x.reshape(len(x), -1)
            metric_weights += exchange * flat @ flat.T  # tr X_P X_Q (X symmetric)
        metric_derivative = auxmol.intor("int2c2e_ip1", comp=3)  # (3, Q, Q): (nabla P|Q)
        by_aux += 2.0 * np.einsum("xpq,pq->xp", metric_derivative, metric_weights)
    # d/dR_A of a function on A is minus its gradient in the electron's coordinate; i and j alike
    gradient = np.zeros((mol.natm, 3))
    np.add.at(gradient, _function_atoms(mol), -2.0 * by_ao.T)
    np.add.at(gradient, _function_atoms(auxmol), -by_aux.T)
    return gradient


def _weights(fitted: np.ndarray, x: np.ndarray, occupied: np.ndarray, dm: np.ndarray, exchange: float
             ) -> np.ndarray:  # fmt: skip
    """(b, N, N) G_P = c_P D - 2 a_x C X_P C^T for a block of fitting functions: ``fitted`` (b,),
    ``x`` (b, nocc, nocc), as two matrix products over the whole block."""
    weights = fitted[:, None, None] * dm
    if exchange:
        (b, nocc, _), n = x.shape, len(dm)
        cx = occupied @ x.transpose(1, 0, 2).reshape(nocc, b * nocc)  # (N, b nocc): C X_P side by side
        cx = cx.reshape(n, b, nocc).transpose(1, 0, 2).reshape(b * n, nocc)
        weights -= 2.0 * exchange * (cx @ occupied.T).reshape(b, n, n)
    return weights


def fitted_intermediates(three: np.ndarray, metric: np.ndarray, occupied: np.ndarray, dm: np.ndarray,
                         exchange: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The fitted density c = M^-1 T D (Q,) and, for exact exchange, X_P = C^T (M^-1 T)_P C
    (Q, nocc, nocc) (empty without), from the 3-centre integrals ``three`` (npair, Q) packed as
    libcint's ``s2ij`` packs them (pairs i >= j), the metric M (Q, Q), the occupied orbitals C
    (N, nocc) and their density D = 2 C C^T (N, N).

    X_P = sum_Q (M^-1)_PQ C^T T_Q C is formed from the small C^T T_Q C, so that M^-1 T, as large as
    T, is never made; T_Q is unpacked a block of fitting functions at a time."""
    import scipy.linalg
    from pyscf import lib

    n, nocc = occupied.shape
    i, j = np.tril_indices(n)
    factor = scipy.linalg.cho_factor(metric, lower=True)
    fitted = scipy.linalg.cho_solve(factor, three.T @ (dm[i, j] * np.where(i == j, 1.0, 2.0)))  # (Q,)
    if not exchange:
        return fitted, np.zeros((len(fitted), 0, 0))
    projected = np.empty((len(fitted), nocc, nocc))  # C^T T_Q C
    for q0 in range(0, len(fitted), FITTED_BLOCK):
        rows = lib.unpack_tril(np.ascontiguousarray(three[:, q0 : q0 + FITTED_BLOCK].T))  # (b, N, N)
        b = len(rows)
        half = (rows.reshape(b * n, n) @ occupied).reshape(b, n, nocc).transpose(1, 0, 2)  # (N, b, nocc) T_Q C
        both = occupied.T @ half.reshape(n, b * nocc)  # (nocc, b nocc): one product for the block
        projected[q0 : q0 + b] = both.reshape(nocc, b, nocc).transpose(1, 0, 2)
    x = scipy.linalg.cho_solve(factor, projected.reshape(len(fitted), -1))
    return fitted, x.reshape(len(fitted), nocc, nocc)


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


FITTED_BLOCK = 128  # fitting functions whose (N, N) matrices are unpacked at once


def _grid(mol, level: int) -> tuple[np.ndarray, np.ndarray]:
    """PySCF's RKS grid of ``mol`` at ``level`` (points (G, 3), weights (G,)), unsorted, unpadded: the
    loop's quadrature."""
    from pyscf import dft

    grids = dft.gen_grid.Grids(mol)
    grids.level = level
    grids.build(with_non0tab=False, sort_grids=False)
    return grids.coords, grids.weights
