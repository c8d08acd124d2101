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

The two-electron part is the derivative of what the run's J-K backend computed: each backend
gives its own (:meth:`~pyscf_ipu.jk.ExactERIs.two_electron_gradient`,
:mod:`pyscf_ipu.two_electron_gradient`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from .programs import MappingBudget, compiled
from .grid import FORCES_GRID_BLOCK, AtomGrids, atom_grids, grid_coords_and_weights
from .method import Method
from .molecule import Molecule
from .pyscf_mole import build_mole
from .integrals.ao_values import ao_values_at
from .integrals.basis import PrimitiveBasis, primitive_basis
from .numint import xc_energy
from .results import SCFResult
from .two_electron_gradient import function_atoms
from .xc.functionals import Functional


def nuclear_gradient(molecule: Molecule, result: SCFResult, method: Method, grid_response: bool = False
                     ) -> np.ndarray:  # fmt: skip
    """(natm, 3) dE/dR in Hartree/Bohr of ``molecule`` at ``result``'s converged orbitals.

    ``grid_response=False`` holds the grid (PySCF's at ``molecule``) fixed in space (PySCF's default
    gradient); True moves the points and Becke weights with the atoms (:mod:`pyscf_ipu.grid`), as
    PySCF's ``grid_response = True`` does: the exact derivative of the energy as the SCF computes it.
    ``method`` is the run's: its functional, its J-K backend, which gives the derivative of the
    two-electron energy it computed, and its dispersion correction, whose gradient is added.
    """
    mol = build_mole(molecule, result.config.basis)
    nocc = molecule.nelectron // 2
    occupied = result.mo_coeff[:, :nocc]  # (N, nocc)
    dm = 2.0 * occupied @ occupied.T
    weighted = 2.0 * (occupied * result.mo_energy[:nocc]) @ occupied.T
    config, functional = result.config, method.functional
    composition = Composition.of(mol, config.basis, config.grid_level, bool(result.grid_points) and bool(
        functional.pieces), grid_response)  # fmt: skip
    fixed = _grid(mol, config.grid_level) if composition.on_grid and not grid_response else ()
    with jax.enable_x64(True):
        # dispatched first: on an accelerator it runs while the host computes the integrals' part
        gradient = grid_and_nuclei_gradient(composition, functional, mol.atom_coords(), dm, fixed)
        one_electron = one_electron_gradient(mol, dm, weighted)
        two_electron = method.backend.two_electron_gradient(mol, config, occupied, functional.hf_exchange)
        return method.dispersion.gradient(molecule, functional, np.asarray(gradient) + one_electron + two_electron)


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
    np.add.at(gradient, function_atoms(mol), -2.0 * by_function)
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
        if composition.grid_response:  # each block places its points and weighs them from the atoms' positions
            atoms = composition.atoms
            per_point = (atoms.offsets, atoms.volumes, atoms.owner)

            def grid(offsets, volumes, owner):
                return grid_coords_and_weights(replace(atoms, offsets=offsets, volumes=volumes, owner=owner), coords)
        else:
            per_point = fixed

            def grid(points, weights):
                return points, weights
        total += _xc_energy_in_blocks(functional, basis, tuple(jnp.asarray(a) for a in per_point), grid, coords, dm)
    first, second = np.triu_indices(len(basis.charges), 1)
    charges = jnp.asarray(basis.charges)
    distance = jnp.linalg.norm(coords[first] - coords[second], axis=-1)
    return total + jnp.sum(charges[first] * charges[second] / distance)


def _xc_energy_in_blocks(functional: Functional, basis: PrimitiveBasis, per_point: tuple, grid, coords, dm):
    """E_xc as a sum over blocks of :data:`FORCES_GRID_BLOCK` points, each block's grid (``grid`` of its
    slice of the ``per_point`` arrays: its (B, 3) points and (B,) weights) and AO values recomputed in
    the gradient's backward pass (``jax.checkpoint``) rather than stored: the gradient then holds one
    block's AO values and derivatives, and one block's Becke cells (B x natm x natm), not the whole
    grid's. The last block is filled with copies of the last point, at zero weight."""
    size = len(per_point[0])
    count = -(-size // FORCES_GRID_BLOCK)
    padded = count * FORCES_GRID_BLOCK

    def blocked(values):
        filled = jnp.pad(values, [(0, padded - size)] + [(0, 0)] * (values.ndim - 1), mode="edge")
        return filled.reshape(count, FORCES_GRID_BLOCK, *values.shape[1:])

    @jax.checkpoint
    def block(total, chunk):
        real, *arrays = chunk
        where, weight = grid(*arrays)
        weight = jnp.where(real, weight, 0.0)
        return total + xc_energy(functional, ao_values_at(basis, where, coords), weight, dm), None

    real = (jnp.arange(padded) < size).reshape(count, FORCES_GRID_BLOCK)
    return jax.lax.scan(block, jnp.zeros((), coords.dtype), (real, *map(blocked, per_point)))[0]


@compiled(static_argnums=(0, 1), budget=MappingBudget())
def grid_and_nuclei_gradient(composition: Composition, functional: Functional, coords, dm, fixed):
    """(natm, 3) the gradient of :func:`_grid_and_nuclei_energy` in ``coords``, as one program: op by
    op, the gradient of the AO values on the grid is slower than compiling it and running it."""
    return jax.grad(_grid_and_nuclei_energy, argnums=2)(composition, functional, coords, dm, fixed)


def _grid(mol, level: int) -> tuple[np.ndarray, np.ndarray]:
    """PySCF's RKS grid of ``mol`` at ``level`` (points (G, 3), weights (G,)), unsorted, unpadded: the
    loop's quadrature."""
    from pyscf import dft

    grids = dft.gen_grid.Grids(mol)
    grids.level = level
    grids.build(with_non0tab=False, sort_grids=False)
    return grids.coords, grids.weights
