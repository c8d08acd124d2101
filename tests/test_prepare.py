"""Host preparation: integrals, screening, grid and guess, checked against PySCF and built-in identities."""

import numpy as np
import pytest
from pyscf import ao2mo, dft, scf

from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.method import resolve
from pyscf_ipu.pyscf_mole import build_mole
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


def test_minao_guess_equals_pyscf_for_cno_f_and_h():
    molecule = from_atom_string("C 0 0 0; N 0 0 1.16; O 1.2 0 -0.7; F -1.3 0 -0.7; H 0 1.0 -0.4; H 0 -1.0 -0.4")
    for basis in ("sto-3g", "6-31g*"):
        mol = build_mole(molecule, basis)
        np.testing.assert_allclose(prepare([molecule], resolve(RKSConfig(basis=basis)))[0].density_guess,
                                   scf.hf.init_guess_by_minao(mol), atol=1e-12)  # fmt: skip


def test_orthogonaliser_and_guess(benzene_host):
    host = benzene_host
    x = host.orthogonaliser
    np.testing.assert_allclose(x.T @ host.overlap @ x, np.eye(x.shape[1]), atol=1e-10)
    # MINAO is a projected atomic guess: its tr(DS) is near, not at, the electron count.
    electrons = np.trace(host.density_guess @ host.overlap)
    assert electrons == pytest.approx(42, rel=0.02)
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
    np.testing.assert_allclose(host.density_guess, scf.hf.init_guess_by_minao(mol), atol=1e-12)  # round-off


def test_missing_elements_and_unknown_basis():
    with pytest.raises(MoleculeError, match="Xe not in basis '6-31g'"):
        build_mole(from_atom_string("Xe 0 0 0"), "6-31g")
    with pytest.raises(MoleculeError, match="unknown basis 'not-a-basis'"):
        build_mole(from_name("water"), "not-a-basis")


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


@pytest.mark.parametrize("precision, atol", [("float64", 1e-10), ("float32", 2e-5)])
def test_device_integrals_switch(precision, atol):
    """``integrals="jax"``: the same overlap, core Hamiltonian and ERIs as libcint, from JAX (on a
    CPU the one-electron integrals come from libcint itself; the device program's are checked in
    :func:`test_conformers_prepared_together_match_libcint_one_by_one`).

    float32: the ERIs within 1e-6 (tests/test_integrals.py), the core Hamiltonian within 2e-5 (its
    nuclear attraction on an O core is ~60 Hartree, where float32 resolves 4e-6)."""
    molecule = from_name("water")
    host = prepare([molecule], resolve(RKSConfig(basis="6-31g*", precision=precision, eri_expcutoff=0.0, xc="hf")))[0]
    device = prepare([molecule], resolve(RKSConfig(basis="6-31g*", precision=precision, integrals="jax", xc="hf")))[0]
    np.testing.assert_allclose(device.overlap, host.overlap, rtol=0, atol=atol)
    np.testing.assert_allclose(device.hcore, host.hcore, rtol=0, atol=atol)
    np.testing.assert_allclose(device.eri_s8, host.eri_s8, rtol=0, atol=min(atol, 1e-6))
    with pytest.raises(ConfigError, match="integrals must be one of libcint, jax"):
        RKSConfig(integrals="gpu")


def test_integral_sources_are_the_config_choices():
    """Each choice of ``RKSConfig.integrals`` names one registered source, and no other name does; the
    old spellings (host, device) resolve to the sources they always meant, and name an unknown one
    never reaches a source."""
    from pyscf_ipu.config import INTEGRALS
    from pyscf_ipu.integral_sources import INTEGRAL_SOURCES, JaxIntegrals, LibcintIntegrals

    assert set(INTEGRAL_SOURCES) == set(INTEGRALS) == {"libcint", "jax"}
    assert all(resolve(RKSConfig(integrals=name)).integrals.name == name for name in INTEGRALS)
    assert isinstance(resolve(RKSConfig(integrals="host")).integrals, LibcintIntegrals)
    assert isinstance(resolve(RKSConfig(integrals="device")).integrals, JaxIntegrals)
    assert RKSConfig(integrals="device") == RKSConfig(integrals="jax")  # one config, whichever spelling


def test_conformers_prepared_together_match_libcint_one_by_one():
    """prepare: one device call for the integrals of three conformers (padded to a batch
    of four), each conformer's overlap and core Hamiltonian (float64 on the device) within 1e-10 and
    its ERIs (float32) within 1e-6 of libcint's at its own geometry; different atoms are refused.
    The one-electron program is called directly: on a CPU ``prepare`` takes libcint's instead."""
    from pyscf_ipu.buckets import SizeBucket
    from pyscf_ipu.integral_sources import device_one_electron

    water = from_name("water")
    rng = np.random.default_rng(3)
    conformers = [water.with_positions(water.positions + 0.1 * rng.normal(size=water.positions.shape))
                  for _ in range(3)]  # fmt: skip
    hosts = prepare(conformers, resolve(RKSConfig(integrals="jax", xc="hf")))
    assert len(hosts) == 3
    for conformer, device in zip(conformers, hosts):
        host = prepare([conformer], resolve(RKSConfig(eri_expcutoff=0.0, xc="hf")))[0]
        np.testing.assert_allclose(device.overlap, host.overlap, rtol=0, atol=1e-10)
        np.testing.assert_allclose(device.hcore, host.hcore, rtol=0, atol=1e-10)
        # the device's s8 array is its size bucket's (water's 2 H padded to 4): the molecule's leads, zeros follow
        size = len(host.eri_s8)
        np.testing.assert_allclose(device.eri_s8[:size], host.eri_s8, rtol=0, atol=1e-6)
        assert not device.eri_s8[size:].any()
        assert device.eri_kept == np.count_nonzero(device.eri_s8)  # counted on the device
    assert np.abs(hosts[0].eri_s8 - hosts[1].eri_s8).max() > 1e-3  # each at its own geometry
    mols = [build_mole(conformer, "sto-3g") for conformer in conformers]
    for (overlap, hcore), mol in zip(device_one_electron(mols, SizeBucket.of(water, "sto-3g", 0)), mols):
        np.testing.assert_allclose(overlap, mol.intor("int1e_ovlp"), rtol=0, atol=1e-10)
        np.testing.assert_allclose(hcore, mol.intor("int1e_kin") + mol.intor("int1e_nuc"), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="one size bucket"):  # water and benzene: two buckets
        prepare([water, from_name("benzene")], resolve(RKSConfig(integrals="jax", xc="hf")))


def test_device_integrals_finalise_j_and_k_on_the_device():
    """With device integrals the finalisation contracts J and K on the device (the loop's float32
    integrals, summed in float64), single and batched. The energy terms must equal libcint's float64
    contraction of the same float32 integrals at the same density: Coulomb within 1e-9 Hartree (the
    same numbers summed in float64 in another order), exact exchange within 1e-8 (K's row matrix
    holds (ij|kl) + (ik|jl) added in float32: one more rounding, 6e-8 relative per element; seen
    here 1.3e-9 Hartree, 3e-5 meV)."""
    from pyscf import scf

    from pyscf_ipu.padding import fill_batch
    from pyscf_ipu.rks import run_rks, submit_batch

    water = from_name("water")
    config = RKSConfig(integrals="jax")
    distorted = water.with_positions(water.positions + 0.1 * np.random.default_rng(5).normal(size=(3, 3)))
    hosts = prepare([water, distorted], resolve(config))
    assert hosts[0].eri_s8.dtype == np.float32 and not hosts[0].eri_s8.flags.writeable  # the device's, no copy
    results = [run_rks(water, config, prepared=hosts[0]), *submit_batch(fill_batch(hosts, 4), resolve(config)).results()[:2]]
    for host, result in zip([hosts[0], *hosts], results):
        npair = host.nao * (host.nao + 1) // 2  # the bucket's s8 array: the molecule's is its leading part
        vj, vk = scf.hf.dot_eri_dm(np.asarray(host.eri_s8[: npair * (npair + 1) // 2], np.float64), result.density,
                                   hermi=1)  # fmt: skip
        assert result.energy_terms["coulomb"] == pytest.approx(0.5 * np.sum(result.density * vj), abs=1e-9)
        exchange = -0.25 * resolve(config).functional.hf_exchange * np.sum(result.density * vk)
        assert result.energy_terms["exact_exchange"] == pytest.approx(exchange, abs=1e-8)
    assert abs(results[1].energy - results[2].energy) > 1e-4  # each conformer its own


@pytest.mark.parametrize("basis", ["sto-3g", "6-31g*"])
def test_device_grid_and_ao_values_match_pyscf(basis):
    """With device integrals the grid is partitioned and the AO values evaluated on the device.

    Each conformer's points and weights equal PySCF's level-0 RKS grid (its two zero-weight alignment
    points aside) to float64 round-off (1e-12); the float32 AO values and gradients that build_batch
    evaluates, for one conformer or two, equal PySCF's ``eval_ao`` within 3e-6 relative to max(1, |value|), the
    bound of tests/test_integrals.py, with zeros on the padded points and AOs. 6-31G* has d shells,
    which go through the spherical transform; STO-3G has none, which skips it.
    """
    from pyscf_ipu.problem import build_batch

    water = from_name("water")
    rng = np.random.default_rng(5)
    conformers = [water.with_positions(water.positions + 0.1 * rng.normal(size=water.positions.shape))
                  for _ in range(2)]  # fmt: skip
    config = RKSConfig(basis=basis, integrals="jax")
    hosts = [prepare([c], resolve(config))[0] for c in conformers]  # one conformer per call: the ERI program of the tests above
    backend = resolve(RKSConfig(jk="dense")).backend
    sizes = (hosts[0].nao + 3, 256 * (hosts[0].grid_points // 256 + 1))
    batch = build_batch(hosts, backend, np.float32, sizes)
    for k, host in enumerate(hosts):
        assert host.ao is None
        grids = dft.gen_grid.Grids(host.mol)
        grids.level = 0
        grids.build(with_non0tab=False, sort_grids=False)
        real = grids.atm_idx >= 0  # PySCF marks its alignment padding with atom -1
        np.testing.assert_allclose(host.grid_coords, grids.coords[real], rtol=0, atol=1e-12)
        np.testing.assert_allclose(host.grid_weights, grids.weights[real], rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(host.grid_owners, grids.atm_idx[real])
        reference = dft.numint.eval_ao(host.mol, host.grid_coords, deriv=1)
        ao = np.asarray(build_batch([host], backend, np.float32, sizes).ao[0], np.float64)
        n, g = host.nao, host.grid_points
        error = np.abs(ao[:, :g, :n] - reference) / np.maximum(1.0, np.abs(reference))
        assert error.max() <= 3e-6, error.max()
        assert not ao[:, g:].any() and not ao[:, :, n:].any()
        np.testing.assert_array_equal(np.asarray(batch.ao[k]), ao.astype(np.float32))


def test_stacking_the_rows_of_one_batch_does_not_copy():
    """stack_padded: arrays that are the rows of one array, all of them in order (the device ERIs of a
    batch), become that array's own buffer; anything else (a subset, another order, a cast) is
    copied into a new stack, with the same values either way."""
    import jax
    import jax.numpy as jnp

    from pyscf_ipu.padding import stack_padded

    batch = jnp.arange(24, dtype=jnp.float32).reshape(4, 6) + 1
    rows = list(np.asarray(batch))  # read-only views of the device buffer, as device_eri_s8 hands out
    whole = stack_padded(rows, np.float32)
    assert whole.unsafe_buffer_pointer() == batch.unsafe_buffer_pointer()
    for parts in (rows[:3], rows[::-1], [rows[0], rows[1].copy(), *rows[2:]]):
        stacked = stack_padded(parts, np.float32)
        assert stacked.unsafe_buffer_pointer() != batch.unsafe_buffer_pointer()
        np.testing.assert_array_equal(np.asarray(stacked), np.stack(parts))
    with jax.enable_x64(True):
        widened = stack_padded(rows, np.float64)
    assert widened.dtype == np.float64 and widened.unsafe_buffer_pointer() != batch.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(widened), np.asarray(batch, np.float64))
