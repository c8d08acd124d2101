"""Host preparation (libcint): integrals, screening, grid and guess, checked against PySCF and built-in
identities; the integral sources by name."""

import warnings

import numpy as np
import pytest
from pyscf import ao2mo, dft, scf

from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.pyscf_mole import _needs_ecp, build_mole
from pyscf_ipu.prepare import prepare
from pyscf_ipu.molecule import MoleculeError, from_atom_string, from_name


@pytest.fixture(scope="module")
def benzene_host():
    return prepare([from_name("benzene")], resolve(RKSConfig()))[0]


def test_sizes_and_grid_match_pyscf(benzene_host):
    host = benzene_host
    assert host.nao == 36 and host.nocc == 21
    # PySCF's RKS grid for benzene at level 0, which PySCF 2.14 does not prune (docs/science.md: 10,240).
    assert host.grid_points == 10240
    assert host.ao.shape == (4, host.grid_points, host.nao)


def test_grid_is_pyscf_rks_grid(benzene_host):
    """The same points and weights as the grid PySCF's RKS builds on its first cycle (its order aside)."""
    host = benzene_host
    ks = dft.RKS(host.mol)
    ks.grids.level = 0
    ks.initialize_grids(host.mol, scf.hf.init_guess_by_minao(host.mol))
    ours = np.lexsort(np.column_stack([host.grid_coords, host.grid_weights]).T)
    theirs = np.lexsort(np.column_stack([ks.grids.coords, ks.grids.weights]).T)
    np.testing.assert_array_equal(host.grid_coords[ours], ks.grids.coords[theirs])
    np.testing.assert_array_equal(host.grid_weights[ours], ks.grids.weights[theirs])


def test_guess_equals_pyscfs_atom_guess_for_cno_f_and_h():
    """The superposition of spherically averaged atomic HF densities in the run's basis, element by
    element from one-atom molecules: PySCF's ``init_guess_by_atom`` of the whole molecule, to round-off."""
    molecule = from_atom_string("C 0 0 0; N 0 0 1.16; O 1.2 0 -0.7; F -1.3 0 -0.7; H 0 1.0 -0.4; H 0 -1.0 -0.4")
    for basis in ("sto-3g", "6-31g*"):
        mol = build_mole(molecule, basis)
        np.testing.assert_allclose(prepare([molecule], resolve(RKSConfig(basis=basis)))[0].density_guess,
                                   scf.hf.init_guess_by_atom(mol), atol=1e-12)  # fmt: skip


def test_orthogonaliser_and_guess(benzene_host):
    host = benzene_host
    x = host.orthogonaliser
    np.testing.assert_allclose(x.T @ host.overlap @ x, np.eye(x.shape[1]), atol=1e-10)
    # block diagonal, each block a neutral atom's own density in its own basis: tr(DS) counts every
    # electron exactly (only the blocks of S on the diagonal meet D)
    electrons = np.trace(host.density_guess @ host.overlap)
    assert electrons == pytest.approx(42, abs=1e-10)
    # The grid integrates the same density to tr(DS) within ~1e-3 at level 0 (docs/science.md).
    rho = np.einsum("gm,mn,gn->g", host.ao[0], host.density_guess, host.ao[0])
    assert np.dot(rho, host.grid_weights) == pytest.approx(electrons, rel=1e-3)


def test_schwarz_screening_drops_small_integrals_only():
    molecule = from_atom_string("C 0 0 0; O 0 0 1.2; H 0 0.9 -0.6; H 0 -0.9 -0.6; Ne 0 0 6")
    full = prepare([molecule], resolve(RKSConfig(eri_threshold=0.0)))[0]
    screened = prepare([molecule], resolve(RKSConfig(eri_threshold=1e-6)))[0]
    dropped = (full.eri_s8 != 0) & (screened.eri_s8 == 0)
    assert screened.eri_kept < full.eri_kept and dropped.any()
    # Schwarz inequality: |(ij|kl)| <= sqrt((ij|ij)(kl|kl)) < threshold for every dropped integral.
    assert np.max(np.abs(full.eri_s8[dropped])) < 1e-6
    kept = screened.eri_s8 != 0
    np.testing.assert_array_equal(screened.eri_s8[kept], full.eri_s8[kept])


@pytest.mark.parametrize("basis, nao", [("sto-3g", 7), ("6-31g", 13), ("6-31g*", 18)])
def test_bases(basis, nao):
    host = prepare([from_name("water")], resolve(RKSConfig(basis=basis)))[0]
    assert host.nao == nao
    mol = build_mole(from_name("water"), basis)
    np.testing.assert_allclose(ao2mo.restore(1, host.eri_s8, nao), mol.intor("int2e"), atol=1e-12)
    np.testing.assert_allclose(host.density_guess, scf.hf.init_guess_by_atom(mol), atol=1e-12)  # round-off


def test_missing_elements_and_unknown_basis():
    with pytest.raises(MoleculeError, match="Xe not in basis '6-31g'"):
        build_mole(from_atom_string("Xe 0 0 0"), "6-31g")
    with pytest.raises(MoleculeError, match="unknown basis 'not-a-basis'"):
        build_mole(from_name("water"), "not-a-basis")
    # def2 describes iodine's valence only, beside a core potential this package does not carry
    with pytest.raises(MoleculeError, match="'def2-svp' needs an effective core potential for I"):
        build_mole(from_atom_string("H 0 0 0; I 0 0 1.6"), "def2-svp")
    assert build_mole(from_atom_string("H 0 0 0; Br 0 0 1.4"), "def2-svp").nao > 0  # all-electron up to Kr
    _needs_ecp.cache_clear()
    with warnings.catch_warnings():  # the check asks PySCF quietly (for a basis PySCF names by no alias, it warns)
        warnings.simplefilter("error")
        build_mole(from_name("water"), "6-31g(2df,p)")
    # cc-pCVDZ, all-electron, is two files to PySCF; cc-pVDZ-PP carries iodine's core potential
    assert build_mole(from_atom_string("N 0 0 0; N 0 0 1.1"), "cc-pcvdz").nao > 0
    with pytest.raises(MoleculeError, match="needs an effective core potential for I"):
        build_mole(from_atom_string("I 0 0 0; I 0 0 2.7"), "cc-pvdz-pp")


def test_hartree_fock_skips_the_grid():
    host = prepare([from_name("water")], resolve(RKSConfig(xc="hf")))[0]
    assert host.grid_points == 0 and host.ao.shape == (4, 0, 7)


def test_eri_primitive_screening_is_below_float32_resolution():
    """libcint's primitive screening at the default exponent cutoff changes integrals by < 1e-7 Ha."""
    molecule = from_name("benzene")
    exact = prepare([molecule], resolve(RKSConfig(eri_expcutoff=0.0, xc="hf")))[0].eri_s8
    screened = prepare([molecule], resolve(RKSConfig(xc="hf")))[0].eri_s8
    coarse = prepare([molecule], resolve(RKSConfig(eri_expcutoff=15.0, xc="hf")))[0].eri_s8
    assert RKSConfig().eri_expcutoff == 30.0
    np.testing.assert_allclose(screened, exact, rtol=0, atol=1e-7)
    assert np.max(np.abs(coarse - exact)) > 1e-7  # the cutoff really screens


def test_integral_sources_are_the_config_choices():
    """Each choice of ``RKSConfig.integrals`` names one registered source, or ``auto``, which picks by the
    platform (here a CPU: the JAX integrals with libcint's density-fitting factor and float32 ERIs; on
    an accelerator with the device's own factor and float64 ERIs); the old spellings (host, device) resolve to the sources they
    always meant, and an unknown name never reaches a source."""
    from pyscf_ipu.config import INTEGRALS
    from pyscf_ipu.integral_sources import (INTEGRAL_SOURCES, DeviceFactor, JaxIntegrals, LibcintFactor,
                                            LibcintIntegrals, auto_integrals)

    assert set(INTEGRAL_SOURCES) | {"auto"} == set(INTEGRALS) == {"libcint", "jax", "auto"}
    assert all(resolve(RKSConfig(integrals=name)).integrals.name == name for name in INTEGRAL_SOURCES)
    auto = resolve(RKSConfig(integrals="auto")).integrals
    assert isinstance(auto, JaxIntegrals) and isinstance(auto.factor, LibcintFactor)
    assert auto.eri_precision == "float32" and JaxIntegrals().eri_precision == "float64"
    on_a_gpu = auto_integrals("gpu")
    assert isinstance(on_a_gpu, JaxIntegrals) and isinstance(on_a_gpu.factor, DeviceFactor)
    assert on_a_gpu.eri_precision == "float64"
    assert isinstance(resolve(RKSConfig(integrals="host")).integrals, LibcintIntegrals)
    assert isinstance(resolve(RKSConfig(integrals="device")).integrals, JaxIntegrals)
    assert RKSConfig(integrals="device") == RKSConfig(integrals="jax")  # one config, whichever spelling
    with pytest.raises(ConfigError, match="integrals must be one of libcint, jax, auto"):
        RKSConfig(integrals="gpu")
