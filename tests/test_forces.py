"""Nuclear gradients (pyscf_ipu.forces) against PySCF's analytic RKS gradient and a finite difference.

Both comparisons hold the quadrature grid fixed in space, as our gradient does: PySCF's default
``nuc_grad_method()`` has no grid response, and the finite difference re-solves the SCF at displaced
atoms on the reference geometry's grid points and weights. Tolerances (tests/tolerances.py), a margin
above the measured errors: 1e-7 Hartree/Bohr for a float64 SCF (water measured 1.6e-8 with B3LYP
and 2.4e-8 with HF against PySCF), 2e-5 for the float32 QM1B settings (within 3e-6 on the
9-heavy-atom molecules: the orbitals come from the float64 Fock matrix of the float32 loop's
density), 2e-6 against central differences (measured 8.7e-7).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pyscf import dft, scf

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.forces import nuclear_gradient
from pyscf_ipu.resolution import resolve
from pyscf_ipu.prepare import prepare
from pyscf_ipu.molecule import Molecule, from_name
from pyscf_ipu.rks import run_rks

from .molecules import QM9, molecule_by_name
from .tolerances import FORCES_FINITE_DIFFERENCE, FORCES_FLOAT32, FORCES_FLOAT64

FLOAT64 = dict(precision="float64", max_iterations=60, stop_commutator=1e-9)


def pyscf_gradient(mol, config: RKSConfig) -> np.ndarray:
    """PySCF's analytic gradient (no grid response), tightly converged in float64."""
    mf = scf.RHF(mol) if config.xc == "hf" else dft.RKS(mol, xc=config.xc)
    if config.xc != "hf":
        mf.grids.level = config.grid_level
    mf.conv_tol = 1e-11
    mf.kernel()
    assert mf.converged
    return mf.nuc_grad_method().kernel()


def with_grid_response(mf, grid_level: int) -> np.ndarray:
    """PySCF's analytic gradient of ``mf`` (an RKS at ``grid_level``) with grid response, tightly
    converged in float64."""
    mf.grids.level = grid_level
    mf.conv_tol = 1e-11
    mf.kernel()
    gradient = mf.nuc_grad_method()
    gradient.grid_response = True
    return gradient.kernel()


def device_gradient(molecule: Molecule, config: RKSConfig) -> np.ndarray:
    """``molecule``'s gradient by the batch's device program (pyscf_ipu.device_forces), a batch of one."""
    from pyscf_ipu.gradients import DeviceGradients
    from pyscf_ipu.problem import prepare_batch
    from pyscf_ipu.rks import submit_batch

    method = resolve(config)
    run = submit_batch(prepare_batch([molecule], method), method)
    (gradient,) = DeviceGradients().dispatch(run, method, [True]).gradients(run.results())
    return gradient


def gradient_of(molecule: Molecule, config: RKSConfig):
    host = prepare([molecule], resolve(config))[0]
    result = run_rks(molecule, config, prepared=host)
    return host, result, nuclear_gradient(molecule, result, resolve(config))


@pytest.mark.parametrize("xc", ["b3lyp", "hf"])
def test_water_gradient_matches_pyscf(xc):
    config = RKSConfig(xc=xc, **FLOAT64)
    host, _, ours = gradient_of(from_name("water"), config)
    ref = pyscf_gradient(host.mol, config)
    print(f"water {xc}: max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(ref).max() > 1e-2  # a geometry with real forces


def test_water_gradient_matches_a_finite_difference_on_a_fixed_grid():
    """Central differences (h = 1e-3 Bohr) of our own float64 energy, the grid held where it is."""
    molecule = from_name("water")
    config = RKSConfig(**FLOAT64)
    host, _, ours = gradient_of(molecule, config)

    def energy(positions: np.ndarray) -> float:
        moved = dataclasses.replace(molecule, positions=positions)
        other = prepare([moved], resolve(config))[0]
        ao = dft.numint.eval_ao(other.mol, host.grid_coords, deriv=1)
        fixed = dataclasses.replace(other, grid_coords=host.grid_coords, grid_weights=host.grid_weights, ao=ao)
        return run_rks(moved, config, prepared=fixed).energy

    h = 1e-3
    for atom, axis in [(0, 2), (1, 1), (2, 2)]:
        step = np.zeros_like(molecule.positions)
        step[atom, axis] = h
        difference = (energy(molecule.positions + step) - energy(molecule.positions - step)) / (2 * h)
        print(f"atom {atom} axis {axis}: analytic {ours[atom, axis]:+.9f}, finite difference {difference:+.9f}")
        assert abs(difference - ours[atom, axis]) < FORCES_FINITE_DIFFERENCE


def test_eri_weights_give_the_coulomb_and_exchange_energies():
    """sum_u w_u (u) over the s8 ERIs (the weights both gradients contract their derivative ERIs with)
    equals E_J - a_x E_K / 2 from PySCF's J and K at the same density."""
    import jax
    import jax.numpy as jnp

    from pyscf_ipu.integrals.eri_gradient import eri_weights

    mol = prepare([from_name("water")], resolve(RKSConfig(eri_expcutoff=0.0, xc="hf")))[0].mol
    eri = mol.intor("int2e", aosym="s8")
    dm = np.random.default_rng(0).normal(size=(mol.nao, mol.nao))
    dm = dm + dm.T
    vj, vk = scf.hf.dot_eri_dm(eri, dm, hermi=1)
    for exchange in (0.0, 0.2, 1.0):
        expected = 0.5 * np.sum(dm * vj) - 0.25 * exchange * np.sum(dm * vk)
        with jax.enable_x64(True):
            weights = np.asarray(eri_weights(jnp.asarray(dm), 1.0, exchange, eri.size, jnp.float64))
        assert np.dot(weights, eri) == pytest.approx(expected, rel=1e-12)


SLOW_FORCES = [pytest.param(name, marks=pytest.mark.slow) for name in ["methane", *QM9[:2]]]


@pytest.mark.parametrize("name", ["benzene", *SLOW_FORCES])
def test_gradient_matches_pyscf_at_qm1b_settings(qm9_nine_heavy, name):
    """The default float32 run (B3LYP/STO-3G, grid level 0, at most 20 iterations) against PySCF;
    benzene in every run of the suite, the rest with ``--slow``."""
    config = RKSConfig()
    host, result, ours = gradient_of(molecule_by_name(name, qm9_nine_heavy), config)
    assert result.converged
    ref = pyscf_gradient(host.mol, config)
    print(f"{name}: max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT32)


def test_water_gradient_with_grid_response_matches_pyscf_and_a_plain_finite_difference():
    """grid_response=True: the grid (pyscf_ipu.grid, PySCF's definition in JAX) moves with the atoms,
    against PySCF's grid_response=True and against central differences of the plain energy."""
    molecule = from_name("water")
    config = RKSConfig(**FLOAT64)
    host = prepare([molecule], resolve(config))[0]
    result = run_rks(molecule, config, prepared=host)
    ours = nuclear_gradient(molecule, result, resolve(config), grid_response=True)
    ref = with_grid_response(dft.RKS(host.mol, xc=config.xc), config.grid_level)
    print(f"water, grid response: max |ours - PySCF| {np.abs(ours - ref).max():.1e}; net force {np.abs(ours.sum(0)).max():.1e}")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(ours.sum(axis=0)).max() < 1e-6  # translation invariance, which the fixed grid lacks

    h = 1e-3
    for atom, axis in [(0, 2), (1, 1)]:
        step = np.zeros_like(molecule.positions)
        step[atom, axis] = h
        energies = [run_rks(dataclasses.replace(molecule, positions=molecule.positions + sign * step), config).energy
                    for sign in (1, -1)]  # fmt: skip
        difference = (energies[0] - energies[1]) / (2 * h)
        print(f"atom {atom} axis {axis}: analytic {ours[atom, axis]:+.9f}, finite difference {difference:+.9f}")
        assert abs(difference - ours[atom, axis]) < FORCES_FINITE_DIFFERENCE, (difference, ours[atom, axis])


def test_jax_grid_is_pyscfs_grid():
    """Points identical and weights within 1e-12 of PySCF's RKS grid (sort_grids=False, its padding
    left out), at levels 0 and 3, on water and a 9-heavy-atom QM9 molecule."""
    import jax

    from pyscf_ipu.grid import atom_grids, grid_coords_and_weights
    from pyscf_ipu.pyscf_mole import build_mole
    from pyscf_ipu.qm9 import qm9_molecules

    for molecule in (from_name("water"), qm9_molecules([21989])[0].molecule):
        mol = build_mole(molecule, "sto-3g")
        for level in (0, 3):
            grids = dft.gen_grid.Grids(mol)
            grids.level = level
            grids.build(sort_grids=False)
            real = grids.atm_idx >= 0
            with jax.enable_x64(True):
                points, weights = grid_coords_and_weights(atom_grids(mol, level), mol.atom_coords())
            np.testing.assert_allclose(np.asarray(points), grids.coords[real], rtol=0, atol=1e-12)
            np.testing.assert_allclose(np.asarray(weights), grids.weights[real], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("xc", ["b3lyp", "hf"])
def test_density_fitted_gradient_matches_pyscfs(xc):
    """``--jk df`` forces against ``mf.density_fit().nuc_grad_method()`` on a molecule built from the
    basis's name, so that PySCF picks its default fitting basis on its own (def2-universal-JKFIT).
    Measured (float64 SCF): 1.7e-9 Hartree/Bohr with HF, 5.9e-9 with B3LYP (the grid held fixed on
    both sides); the tolerance is the float64 one (tests/tolerances.py)."""
    from pyscf import gto

    molecule = from_name("water")
    config = RKSConfig(xc=xc, basis="def2-svp", jk="df", **FLOAT64)
    _, result, ours = gradient_of(molecule, config)
    mol = gto.M(atom=molecule.pyscf_atom(), unit="Bohr", basis="def2-svp", verbose=0)
    mf = (scf.RHF(mol) if xc == "hf" else dft.RKS(mol, xc=xc)).density_fit()
    if xc != "hf":
        mf.grids.level = config.grid_level
    mf.conv_tol = 1e-11
    mf.kernel()
    ref = mf.nuc_grad_method().kernel()
    print(f"water {xc} def2-svp, density fitted: energy {result.energy - mf.e_tot:+.1e} Hartree, "
          f"max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    assert abs(result.energy - mf.e_tot) < 1e-8  # the same fitting basis: the same energy
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(ref).max() > 1e-2


def test_float32_forces_are_refined_in_float64_to_pyscfs():
    """A float32 loop stops near its own rounding floor (benzene at def2-SVP: max|FDS - SDF| 7e-6), and
    gradients are first order in the orbitals' error: 3.0e-6 Hartree/Bohr from PySCF's density-fitted
    gradient as the loop leaves them. The refinement that ``for_forces`` asks for continues the SCF in
    float64 to max|FDS - SDF| < 5e-7: measured 9e-8 Hartree/Bohr, bounded here at 3e-7."""
    from pyscf import gto

    molecule = from_name("benzene")
    mol = gto.M(atom=molecule.pyscf_atom(), unit="Bohr", basis="def2-svp", verbose=0)
    mf = dft.RKS(mol, xc="b3lyp").density_fit()
    mf.grids.level = 0
    mf.conv_tol = 1e-11
    mf.kernel()
    ref = mf.nuc_grad_method().kernel()
    loop_only = RKSConfig(basis="def2-svp", jk="df", refine_commutator=0.0)
    errors = {}
    for config in (loop_only, RKSConfig(basis="def2-svp", jk="df").for_forces()):
        result = run_rks(molecule, config)
        errors[config.refine_threshold] = np.abs(nuclear_gradient(molecule, result, resolve(config)) - ref).max()
    refined = result
    print(f"benzene def2-svp float32: max |ours - PySCF| {errors[0.0]:.1e} from the loop, {errors[5e-7]:.1e} "
          f"after {refined.refined} float64 iterations")  # fmt: skip
    assert 0 < refined.refined and refined.refined_commutator < 5e-7
    assert errors[5e-7] < 3e-7
    assert errors[5e-7] < errors[0.0] / 5  # the refinement did the work, not the loop


def test_the_exact_two_electron_gradient_survives_its_plans_tables_leaving_the_cache():
    """The compiled gradient outlives the ERI plan's device tables in their small caches: once other
    plans have pushed them out, a new trace (another precision) must not build them inside itself,
    where the cache would keep that trace's values for every later use of the plan."""
    from pyscf_ipu.integral_sources import eri_plan
    from pyscf_ipu.integrals.eri import eri_s8, eri_structure
    from pyscf_ipu.molecule import from_name
    from pyscf_ipu.pyscf_mole import build_mole
    from pyscf_ipu.two_electron_gradient import exact_two_electron_gradient

    mol = build_mole(from_name("water"), "sto-3g")
    occupied = np.linalg.qr(np.random.default_rng(0).normal(size=(7, 5)))[0]
    single = exact_two_electron_gradient(mol, "sto-3g", occupied, 0.2, "float32")
    for elements in (("C", "H"), ("N", "H"), ("O", "O"), ("C", "O"), ("N", "N")):
        eri_structure(eri_plan("sto-3g", elements))
    double = exact_two_electron_gradient(mol, "sto-3g", occupied, 0.2, "float64")
    assert np.abs(single - double).max() < 1e-6  # float32 against float64 (measured 2.3e-7)
    eri_s8(eri_plan("sto-3g", tuple(mol.elements)), mol.atom_coords()[None])  # the plan's tables still usable


def test_one_device_program_gives_two_compositions_pyscfs_gradients_with_grid_response():
    """The batch's device program (pyscf_ipu.device_forces, on the JAX integrals) for water and
    ammonia, two compositions of one size bucket in one batch, at float64 B3LYP/STO-3G: one compiled
    program serves both, and each conformer's gradient is PySCF's analytic gradient with grid
    response and the host path's (pyscf_ipu.gradients), each within the float64 tolerance (measured
    2.4e-8 Hartree/Bohr on water); the net force vanishes as the moving grid makes it; a filled
    batch's copy, not wanted, is skipped. The float32
    program runs in tests/test_optimize.py, to geomeTRIC's and PySCF's minimum."""
    from pyscf_ipu.device_forces import exact_program
    from pyscf_ipu.gradients import DeviceGradients, HostGradients
    from pyscf_ipu.molecule import from_atom_string
    from pyscf_ipu.padding import fill_batch
    from pyscf_ipu.problem import prepare_batch
    from pyscf_ipu.rks import submit_batch

    molecules = [from_name("water"), from_atom_string("N 0 0 0.12; H 0 0.94 -0.27; H 0.81 -0.47 -0.27; H -0.81 -0.47 -0.27")]
    method = resolve(RKSConfig(integrals="jax", **FLOAT64))
    assert method.bucket(molecules[0]) == method.bucket(molecules[1])
    signatures = exact_program.signatures
    run = submit_batch(prepare_batch(fill_batch(molecules, 3), method), method)  # a filled batch's copy last
    results = run.results()
    pending = DeviceGradients().dispatch(run, method, [True, True, False])
    device = pending.gradients(results)
    host = HostGradients().dispatch(run, method, [True, True, False]).gradients(results)
    assert exact_program.signatures == signatures + 1
    # the copy's gradient is not given, and its two-electron part was branched around on the device
    assert device[2] is None and host[2] is None and not np.asarray(pending.parts[1])[2].any()
    for molecule, ours, theirs in zip(molecules, device, host):
        mol = prepare([molecule], resolve(RKSConfig(**FLOAT64)))[0].mol
        ref = with_grid_response(dft.RKS(mol, xc=method.config.xc), method.config.grid_level)
        print(f"{molecule.formula}, device program: max |ours - PySCF| {np.abs(ours - ref).max():.1e}, "
              f"|ours - host| {np.abs(ours - theirs).max():.1e} Hartree/Bohr")
        np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=FORCES_FLOAT64)
        assert np.abs(ours.sum(axis=0)).max() < 1e-6 and np.abs(ref).max() > 1e-2


@pytest.mark.parametrize("name", ["stretched H2", pytest.param("water", marks=pytest.mark.slow)])
def test_density_fitted_device_gradients_match_pyscfs_with_grid_response(name):
    """A density-fitted batch on the JAX integrals, its two-electron part from the device's derivative
    3-centre and metric integrals (pyscf_ipu.integrals.fitting_gradient), against PySCF's
    density-fitted gradient with grid response (def2-SVP, float64): measured 2.3e-8 on water, whose
    s, p and d orbital shells and fitting shells up to f make a program that holds several GB while
    it compiles (so it runs with --slow); H2 stretched to 0.9 Angstrom (s and p shells, fitting up to
    d) in every run: measured 1.0e-8."""
    from pyscf import gto

    from pyscf_ipu.molecule import from_atom_string

    molecule = from_name(name) if name == "water" else from_atom_string("H 0 0 0; H 0 0 0.9", name="h2")
    config = RKSConfig(basis="def2-svp", jk="df", integrals="jax", **FLOAT64)
    ours = device_gradient(molecule, config)
    mol = gto.M(atom=molecule.pyscf_atom(), unit="Bohr", basis="def2-svp", verbose=0)
    ref = with_grid_response(dft.RKS(mol, xc=config.xc).density_fit(), config.grid_level)
    print(f"{name} def2-svp, device program: max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(ref).max() > 1e-2  # a geometry with real forces
