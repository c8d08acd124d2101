"""f shells on the device's integral path: the integrals against libcint's, and labels and forces at
the bases that carry f functions (6-31G(2df,p), QM9's; def2-TZVP) against PySCF's same method in
float64. g shells are refused with one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pyscf import dft, gto

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.integrals.basis import MAX_L, UnsupportedBasisError, primitive_basis
from pyscf_ipu.integrals.eri import eri_s8
from pyscf_ipu.integrals.eri_plan import plan_eri
from pyscf_ipu.integrals.one_electron import one_electron_at
from pyscf_ipu.molecule import from_name
from pyscf_ipu.pyscf_mole import build_mole
from pyscf_ipu.rks import run_rks
from pyscf_ipu.units import HARTREE_TO_MEV

from .tolerances import LABEL_MEV

QM9_BASIS = "6-31g(2df,p)"


def test_f_is_the_highest_orbital_shell_and_g_is_refused():
    assert MAX_L == 3
    with pytest.raises(UnsupportedBasisError, match=r"g functions on C: only s, p, d and f shells"):
        primitive_basis(gto.M(atom="C 0 0 0; O 0 0 1.2", basis="cc-pvqz", verbose=0))


def test_f_shell_eris_match_libcint():
    """(sf|sf) classes in every position of a quartet, up to (ff|ff) at Hermite order 12, on two
    atoms: float64 within 1e-10 and float32 within 1e-6 of libcint's packed s8 ERIs, the bounds of
    the d-shell test (measured 1.4e-14 and 1.5e-7)."""
    jax.clear_caches()  # the (ff|ff) class's code is large; start from no other plan's
    shells = [[0, [1.3, 1.0]], [3, [0.8, 0.6], [2.4, 0.5]]]
    mol = gto.M(atom="C 0 0 0; O 0.1 -0.2 2.13", unit="Bohr", basis={"C": shells, "O": shells}, verbose=0)
    plan = plan_eri(mol)
    ref = mol.intor("int2e", aosym="s8")
    with jax.enable_x64(True):
        ours64 = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float64)[0])
    np.testing.assert_allclose(ours64, ref, rtol=0, atol=1e-10)
    ours32 = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float32)[0], np.float64)
    print(f"(sf|sf): {ref.size:,} ERIs, float64 {np.abs(ours64 - ref).max():.1e}, "
          f"float32 {np.abs(ours32 - ref).max():.1e}")
    assert np.abs(ours32 - ref).max() <= 1e-6
    assert np.abs(ref).max() > 0.1


def test_gathering_r_gives_the_concatenations_eris_bitwise(monkeypatch, request):
    """The layout f-shell classes take (R materialised, then gathered) against the one d-shell classes
    keep (slices concatenated), on the d-shell test basis (2sp and d shells of carbon monoxide): the
    same float32 ERIs to the last bit, so the threshold between them changes no label."""
    from pyscf_ipu.integrals import eri_kernels

    basis = {element: [gto.load("6-31g*", element)[k] for k in (1, 3, 5)] for element in "CO"}
    mol = gto.M(atom="C 0 0 0; O 0.1 -0.2 2.13", unit="Bohr", basis=basis, verbose=0)
    program = eri_kernels.quartet_program
    monkeypatch.setattr(program, "_file", lambda key: None)  # traced here, never read from or written to disk
    program.clear()
    request.addfinalizer(program.clear)  # no later test may run the gathering layout's programs
    concatenated = np.asarray(eri_s8(plan_eri(mol), mol.atom_coords()[None], jnp.float32)[0])
    barriers = []  # the gathering layout's materialisations, traced

    def barrier(x):
        barriers.append(1)
        return optimization_barrier(x)

    optimization_barrier = jax.lax.optimization_barrier
    monkeypatch.setattr(jax.lax, "optimization_barrier", barrier)
    monkeypatch.setattr(eri_kernels, "GATHERED_ORDER", 0)  # every class gathers
    program.clear()
    gathered = np.asarray(eri_s8(plan_eri(mol), mol.atom_coords()[None], jnp.float32)[0])
    assert barriers  # the program was traced again, in the gathering layout
    np.testing.assert_array_equal(gathered, concatenated)
    assert np.abs(concatenated).max() > 0.1


@pytest.mark.parametrize("basis", [QM9_BASIS, "def2-tzvp"])
def test_f_shell_one_electron_integrals_and_ao_values_match_pyscf(basis):
    """Overlap, kinetic and nuclear attraction in float64 within 1e-10 of libcint's; AO values and
    gradients within 1e-12 (float64) and 3e-6 relative (float32) of ``eval_ao``, as for d shells
    (measured: 1.2e-13, 1.4e-14 and 4.8e-7)."""
    from pyscf_ipu.integrals.ao_values import ao_kernel, ao_tables, constants

    mol = build_mole(from_name("water"), basis)
    basis_ = primitive_basis(mol)
    with jax.enable_x64(True):
        ours = jax.jit(lambda coords: one_electron_at(basis_, coords))(jnp.asarray(basis_.coords))
    for key, integral in (("overlap", "int1e_ovlp"), ("kinetic", "int1e_kin"), ("nuclear", "int1e_nuc")):
        np.testing.assert_allclose(np.asarray(ours[key]), mol.intor(integral), rtol=0, atol=1e-10, err_msg=key)

    grids = dft.gen_grid.Grids(mol)
    grids.level = 0
    grids.build(sort_grids=False)
    coords, owners = grids.coords[::5], np.maximum(grids.atm_idx[::5], 0)
    ref = dft.numint.eval_ao(mol, coords, deriv=1)
    tables = ao_tables(basis_)

    def values(dtype):
        table = constants(tables)._cast(lambda a: jnp.asarray(a, dtype))
        offsets = jnp.asarray(coords - basis_.coords[owners], dtype)
        shifts = jnp.asarray(basis_.coords[:, None, :] - basis_.coords[tables.atom][None, :, :], dtype)
        return np.asarray(jax.jit(ao_kernel)(table, offsets, shifts, owners, np.ones(len(coords), bool)), np.float64)

    with jax.enable_x64(True):
        np.testing.assert_allclose(values(jnp.float64), ref, rtol=0, atol=1e-12)
    assert (np.abs(values(jnp.float32) - ref) / np.maximum(1.0, np.abs(ref))).max() <= 3e-6


@pytest.mark.parametrize("name, basis", [
    ("water", QM9_BASIS),
    pytest.param("water", "def2-tzvp", marks=pytest.mark.slow),
    pytest.param("qm9:21989", QM9_BASIS, marks=pytest.mark.slow),
    pytest.param("qm9:21989", "def2-tzvp", marks=pytest.mark.slow)])  # fmt: skip
def test_labels_at_f_shell_bases_within_half_a_mev_of_pyscf(reference, qm9_nine_heavy, name, basis):
    """B3LYP in the float32 loop, density fitted on the device's integrals (f orbital shells, fitting
    shells to g), against PySCF's density-fitted B3LYP in float64 with the same grid and fitting basis:
    each label within the 0.5 meV guard."""
    from .molecules import molecule_by_name

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(basis=basis, jk="df", integrals="jax")
    result = run_rks(molecule, config)
    ref = reference(molecule, config)
    mev = {k: abs(getattr(result, k) - getattr(ref, k)) * HARTREE_TO_MEV for k in ("energy", "homo", "lumo", "gap")}
    print(f"{name} b3lyp/{basis} jax df: " + ", ".join(f"{k} {v:.4f}" for k, v in mev.items()) + " meV")
    assert result.converged and max(mev.values()) < LABEL_MEV, mev


@pytest.mark.slow
def test_device_forces_at_an_f_shell_basis_match_pyscfs_with_grid_response():
    """The batch's device gradient program (derivative 3-centre and metric integrals, f orbital shells)
    on water at 6-31G(2df,p) in float64, against PySCF's density-fitted gradient with grid response:
    within the float64 bound 1e-7 Hartree/Bohr (measured 8.4e-9). Its program takes minutes to compile
    on a CPU, so it runs with --slow."""
    from .test_forces import FLOAT64, device_gradient, with_grid_response
    from .tolerances import FORCES_FLOAT64

    from pyscf_ipu.reference import pyscf_method
    from pyscf_ipu.resolution import resolve

    molecule = from_name("water")
    config = RKSConfig(basis=QM9_BASIS, jk="df", integrals="jax", **FLOAT64)
    ours = device_gradient(molecule, config)
    # the same fitting basis, named: PySCF's default for a Mole whose basis is data is an even-tempered one
    ref = with_grid_response(pyscf_method(molecule, resolve(config)), config.grid_level)
    print(f"water {QM9_BASIS}, device program: max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=FORCES_FLOAT64)
    assert np.abs(ref).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("basis", [QM9_BASIS, "def2-tzvp"])
def test_a_users_forces_at_f_shell_bases_match_pyscfs_at_nine_heavy_atoms(basis):
    """``pyscf-ipu run --forces`` as a user runs it (the float32 loop on the device's integrals,
    refined in float64; the derivative integrals from libcint; the grid moving with the atoms) on
    an RDKit conformer of indole (9 heavy atoms, far from its DFT minimum), against PySCF's
    density-fitted B3LYP gradient with grid response in the same fitting basis: within 2e-6
    Hartree/Bohr (measured 7.9e-7 at 6-31G(2df,p), 3.0e-7 at def2-TZVP). Minutes on a CPU: --slow."""
    from qm1b.conformers import embed_conformers
    from pyscf_ipu.forces import nuclear_gradient
    from pyscf_ipu.reference import pyscf_method
    from pyscf_ipu.resolution import resolve

    from .test_forces import with_grid_response

    (molecule,) = embed_conformers("c1ccc2[nH]ccc2c1", 1, 1, 0)
    config = RKSConfig(basis=basis, xc="b3lyp", grid_level=3, jk="df", integrals="jax").for_forces()
    method = resolve(config)
    result = run_rks(molecule, config)
    ours = nuclear_gradient(molecule, result, method, grid_response=True)
    ref = with_grid_response(pyscf_method(molecule, method), config.grid_level)
    print(f"indole {basis}: max |ours - PySCF| {np.abs(ours - ref).max():.1e} Hartree/Bohr")
    assert result.converged and result.refined > 0
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)
    assert np.abs(ref).max() > 1e-2  # a geometry with real forces
