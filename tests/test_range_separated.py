"""Range-separated hybrids (ωB97X, ωB97X-D): labels and forces against PySCF's same method in float64, and
the runs they refuse for now, each with one line."""

from __future__ import annotations

import numpy as np
import pytest

from pyscf_ipu.cli import differences_mev
from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.jk.range_separated import RangeSeparatedJK
from pyscf_ipu.resolution import resolve
from pyscf_ipu.rks import run_rks
from pyscf_ipu.xc.functionals import FUNCTIONALS

from .tolerances import LABEL_MEV


@pytest.mark.parametrize("xc", ["wb97x", "wb97x-d"])
def test_the_exchange_weights_are_pyscfs(xc):
    """a K + b K_ω with PySCF's (hyb, alpha - hyb) and ω, through libxc's own parameters."""
    from pyscf import dft

    functional = FUNCTIONALS[xc]
    omega, alpha, hyb = dft.numint.NumInt().rsh_and_hybrid_coeff(functional.libxc_code)
    assert functional.hf_exchange == pytest.approx(hyb, abs=1e-12)
    assert functional.long_range_exchange == pytest.approx(alpha - hyb, abs=1e-12)
    assert functional.omega == omega and functional.exchange_factor == 1.0
    assert FUNCTIONALS["b3lyp"].exchange_factor == 0.2 and not FUNCTIONALS["b3lyp"].range_separated


@pytest.mark.parametrize("name, basis, integrals, jk", [
    ("water", "6-31g*", "auto", "df"), ("qm9:21989", "6-31g*", "auto", "df"), ("water", "6-31g*", "jax", "df"),
    ("qm9:21989", "sto-3g", "auto", "ipu"), ("water", "sto-3g", "jax", "ipu"),
    pytest.param("qm9:21989", "def2-svp", "auto", "df", marks=pytest.mark.slow),
    pytest.param("qm9:21989", "6-31g*", "jax", "df", marks=pytest.mark.slow),
    pytest.param("qm9:21989", "sto-3g", "jax", "dense", marks=pytest.mark.slow)])  # fmt: skip
def test_wb97x_labels_within_half_a_mev_of_pyscf(reference, qm9_nine_heavy, name, basis, integrals, jk):
    """ωB97X in the float32 loop against PySCF's ωB97X in float64 with the same grid (and fitting basis,
    where fitted): every label within the 0.5 meV guard (measured at most 0.072 meV). Density fitted:
    ``auto`` is the CPU's path (libcint's factor and its long-range twin), ``jax`` the accelerator's
    (the device's fitting kernels, attenuated, and the long-range metric's eigenvectors). Exact: the
    device's ERI kernels for both operators, float32 ERIs (``auto`` on a CPU) or float64 (``jax``)."""
    from .molecules import molecule_by_name

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(basis=basis, xc="wb97x", jk=jk, integrals=integrals)
    assert isinstance(resolve(config).backend, RangeSeparatedJK)
    result = run_rks(molecule, config)
    ref = reference(molecule, config)
    mev = {k: abs(v) for k, v in differences_mev(result, ref).items()}
    print(f"{name}/{basis}/{integrals}/{jk} wb97x: {mev}")
    assert result.converged and max(mev.values()) < LABEL_MEV, mev
    # the long-range exchange is really there: B3LYP's exchange weights would be far off
    assert abs(result.energy_terms["exact_exchange"]) > 0.5


@pytest.mark.parametrize("name, basis", [
    ("water", "6-31g*"), pytest.param("qm9:21989", "def2-svp", marks=pytest.mark.slow),
    pytest.param("qm9:21989", "6-31g*", marks=pytest.mark.slow)])  # fmt: skip
def test_wb97x_d_labels_within_half_a_mev_of_pyscf(reference, qm9_nine_heavy, name, basis):
    """ωB97X-D's functional (libxc's HYB_GGA_XC_WB97X_D, ω = 0.2) in the float32 loop, density fitted on
    the CPU's path, against PySCF's in float64 with the same grid and fitting basis: every label within
    the 0.5 meV guard. PySCF has no ωB97X-D dispersion, so both run without it here; with it, the run's
    energy moves by the correction's own term (checked against Psi4 in test_dispersion) and nothing else."""
    from .molecules import molecule_by_name

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(basis=basis, xc="wb97x-d", dispersion="none", jk="df", integrals="auto")
    result = run_rks(molecule, config)
    ref = reference(molecule, config)
    mev = {k: abs(v) for k, v in differences_mev(result, ref).items()}
    print(f"{name}/{basis} wb97x-d: {mev}")
    assert result.converged and max(mev.values()) < LABEL_MEV, mev
    with_own = run_rks(molecule, config.replace(dispersion="chg"))
    assert with_own.energy_terms["dispersion"] < 0
    assert with_own.energy - result.energy == pytest.approx(with_own.energy_terms["dispersion"], abs=1e-9)
    np.testing.assert_array_equal(with_own.mo_energy, result.mo_energy)


@pytest.mark.parametrize("changes", [dict(jk="ipu"), dict(jk="df", integrals="libcint"), dict(jk="dense")])
def test_range_separated_runs_the_sources_cannot_make_are_refused(changes):
    with pytest.raises(ConfigError, match=r"--xc wb97x \(range-separated exchange\) needs"):
        resolve(RKSConfig(xc="wb97x", **changes))


@pytest.mark.parametrize("name, basis, xc", [
    ("water", "6-31g*", "wb97x"), pytest.param("qm9:21989", "6-31g*", "wb97x", marks=pytest.mark.slow),
    pytest.param("qm9:21989", "def2-svp", "wb97x", marks=pytest.mark.slow), ("water", "def2-svp", "wb97x-d"),
    pytest.param("qm9:21989", "def2-svp", "wb97x-d", marks=pytest.mark.slow)])  # fmt: skip
def test_density_fitted_wb97x_forces_match_pyscfs_gradient(qm9_nine_heavy, name, basis, xc):
    """ωB97X's and ωB97X-D's nuclear gradients density fitted (the host's: libcint's derivative 3-centre
    and metric integrals of both operators, the long range's metric pseudo-inverted where singular, as
    PySCF's) against PySCF's density-fitted gradients in float64 at the same grid and fitting basis:
    within the float32 settings' 2e-5 Hartree/Bohr. ωB97X-D without its dispersion, which PySCF lacks
    (its gradient is checked against Psi4's in test_dispersion)."""
    from pyscf import dft

    from pyscf_ipu.forces import nuclear_gradient
    from pyscf_ipu.pyscf_mole import build_mole

    from .molecules import molecule_by_name
    from .tolerances import FORCES_FLOAT32

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(xc=xc, dispersion="none", basis=basis, jk="df", integrals="auto").for_forces()
    method = resolve(config)
    ours = nuclear_gradient(molecule, run_rks(molecule, config), method)
    mf = dft.RKS(build_mole(molecule, basis), xc=method.functional.libxc_code)
    mf = method.backend.pyscf_counterpart(mf, basis)  # the same fitting basis
    mf.grids.level, mf.conv_tol, mf.verbose = 0, 1e-12, 0
    mf.kernel()
    reference = mf.nuc_grad_method().kernel()
    print(f"{name}/{basis} density fitted: largest difference {np.abs(ours - reference).max():.1e} Hartree/Bohr")
    assert np.abs(ours - reference).max() < FORCES_FLOAT32
    assert np.abs(reference).max() > 1e-3  # not an equilibrium geometry: real forces to get right


@pytest.mark.parametrize("name", ["water", pytest.param("qm9:21989", marks=pytest.mark.slow)])
def test_wb97x_forces_match_pyscfs_gradient(qm9_nine_heavy, name):
    """ωB97X's nuclear gradient on the exact ERIs (the long-range exchange's derivative through the
    device's attenuated ERI kernels, the rest as for any hybrid) against PySCF's analytic ωB97X gradient
    in float64 at the same grid: within the float32 settings' 2e-5 Hartree/Bohr (measured: water 2.9e-7, the
    9-heavy-atom molecule 3.3e-6)."""
    from pyscf import dft

    from pyscf_ipu.forces import nuclear_gradient
    from pyscf_ipu.pyscf_mole import build_mole

    from .molecules import molecule_by_name
    from .tolerances import FORCES_FLOAT32

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(xc="wb97x", basis="sto-3g", jk="ipu", integrals="auto").for_forces()
    method = resolve(config)
    ours = nuclear_gradient(molecule, run_rks(molecule, config), method)
    mf = dft.RKS(build_mole(molecule, "sto-3g"), xc="wb97x")
    mf.grids.level, mf.conv_tol, mf.verbose = 0, 1e-12, 0
    mf.kernel()
    reference = mf.nuc_grad_method().kernel()
    print(f"{name}: largest difference {np.abs(ours - reference).max():.1e} Hartree/Bohr")
    assert np.abs(ours - reference).max() < FORCES_FLOAT32


def test_the_loops_exchange_is_the_weighted_sum_of_both_operators():
    """The wrapper's K is a K + b K_ω of the wrapped backend's two contractions, and its J the Coulomb one."""
    from pyscf_ipu.packed import RangeSeparatedERIs
    from pyscf_ipu.xc.functionals import Functional

    class Scaled:  # a stand-in backend: J = 2 dm x s, K = 3 dm x s for its operator's scale s
        def contract(self, data, dm):
            return 2.0 * data * dm, 3.0 * data * dm

    weights = Functional("weights", (), 0.25, "none", long_range_exchange=0.75, omega=0.3)
    backend = RangeSeparatedJK(Scaled(), weights)
    dm = np.arange(4.0).reshape(2, 2)
    vj, vk = backend.contract(RangeSeparatedERIs(1.0, 10.0), dm)
    np.testing.assert_allclose(vj, 2.0 * dm)
    np.testing.assert_allclose(vk, 0.25 * 3.0 * dm + 0.75 * 30.0 * dm)


@pytest.mark.parametrize("basis, jk, name", [
    ("sto-3g", "dense", "water"), ("def2-svp", "df", "stretched H2"),
    pytest.param("def2-svp", "df", "water", marks=pytest.mark.slow)])  # fmt: skip
def test_the_device_programs_wb97x_forces_match_pyscfs_with_grid_response(basis, jk, name):
    """ωB97X's gradient by the batch's device program (the JAX integrals: the GPU's path), its long-range
    exchange from the device's derivative integrals of erf(ω r)/r (exact: the attenuated ERIs; density
    fitted: the attenuated 3-centre and metric integrals, the metric pseudo-inverted as the SCF's factor
    was), against PySCF's analytic ωB97X gradient with grid response in float64 (density fitted with the
    same fitting basis): within the float64 tolerance (measured: water at STO-3G 2.0e-8, H2 at def2-SVP
    7.2e-9 Hartree/Bohr), and against the host's gradient of the same SCF (within 1e-13)."""
    from pyscf import dft, gto

    from pyscf_ipu.gradients import DeviceGradients, HostGradients
    from pyscf_ipu.molecule import from_atom_string, from_name
    from pyscf_ipu.problem import prepare_batch
    from pyscf_ipu.rks import submit_batch

    from .test_forces import FLOAT64, with_grid_response
    from .tolerances import FORCES_FLOAT64

    molecule = from_name(name) if name == "water" else from_atom_string("H 0 0 0; H 0 0 0.9", name="h2")
    method = resolve(RKSConfig(xc="wb97x", basis=basis, jk=jk, integrals="jax", **FLOAT64))
    run = submit_batch(prepare_batch([molecule], method), method)
    results = run.results()
    (ours,) = DeviceGradients().dispatch(run, method, [True]).gradients(results)
    (host,) = HostGradients().dispatch(run, method, [True]).gradients(results)
    mf = dft.RKS(gto.M(atom=molecule.pyscf_atom(), unit="Bohr", basis=basis, verbose=0), xc="wb97x")
    mf = method.backend.pyscf_counterpart(mf, basis)
    reference = with_grid_response(mf, method.config.grid_level)
    print(f"{name} {basis} wb97x, device program: max |ours - PySCF| {np.abs(ours - reference).max():.1e}, "
          f"|ours - host| {np.abs(ours - host).max():.1e} Hartree/Bohr")
    np.testing.assert_allclose(ours, reference, rtol=0, atol=FORCES_FLOAT64)
    np.testing.assert_allclose(ours, host, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(reference).max() > 1e-2  # a geometry with real forces


def test_the_fitted_gradients_metric_solver_pseudo_inverts_a_singular_metric():
    """A positive definite metric is solved by Cholesky (as numpy's solve); a singular one, as the
    long-range metric is, by its eigenvectors above PySCF's 1e-7 (an eigenvalue of 1e-9 is dropped,
    one of 1e-6 kept), the pseudo-inverse PySCF's density-fitted gradient takes."""
    from pyscf_ipu.two_electron_gradient import metric_solver

    rng = np.random.default_rng(0)
    vectors, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    x = rng.normal(size=(5, 3))
    definite = vectors @ np.diag([3.0, 2.0, 1.0, 0.5, 0.1]) @ vectors.T
    np.testing.assert_allclose(metric_solver(definite)(x), np.linalg.solve(definite, x), rtol=1e-12, atol=1e-12)
    eigenvalues = np.array([3.0, 2.0, 1e-6, 1e-9, -1e-10])
    singular = vectors @ np.diag(eigenvalues) @ vectors.T
    kept = vectors[:, :3]
    expected = kept @ np.diag(1.0 / eigenvalues[:3]) @ kept.T @ x
    np.testing.assert_allclose(metric_solver(singular)(x), expected, rtol=1e-6)  # 1e-6 kept: cond 3e6
