"""Device integrals (pyscf_ipu.integrals) against libcint and against the Boys function's definition.

Tolerances (docs/science.md): float64 within 1e-10 Hartree (round-off is ~1e-13 here); float32 ERIs
within 1e-6 absolute. The one-electron integrals are computed in float64 only (the assembly's, and
the forces'). The kernels run here on each molecule's own layout; :mod:`tests.test_assembly` runs
them on size buckets' templates.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pyscf import gto
from scipy.special import hyp1f1

from pyscf_ipu.pyscf_mole import build_mole
from pyscf_ipu.integrals.basis import cartesian_powers, primitive_basis
from pyscf_ipu.integrals.boys import MAX_ORDER, boys, boys_family
from pyscf_ipu.integrals.eri import eri_s8
from pyscf_ipu.integrals.eri_plan import plan_eri
from pyscf_ipu.integrals.hermite import hermite_coulomb, hermite_coulomb_stacked, hermite_indices
from pyscf_ipu.integrals.one_electron import one_electron_at
from pyscf_ipu.molecule import from_name
from pyscf_ipu.qm9 import qm9_molecules

MOLECULES = {"water": lambda: from_name("water"), "benzene": lambda: from_name("benzene"),
             "qm9-21989": lambda: qm9_molecules([21989])[0].molecule,
             "qm9-53938": lambda: qm9_molecules([53938])[0].molecule}  # fmt: skip


def boys_reference(m, t):
    """F_m(T) = 1F1(m + 1/2; m + 3/2; -T) / (2m + 1) (float64, scipy)."""
    return hyp1f1(m + 0.5, m + 1.5, -t) / (2 * m + 1)


def test_boys_function_over_its_whole_range():
    """Against scipy's 1F1 (an independent route), on both branches and across every switch T = m + 2."""
    t = np.concatenate([[0.0, 1e-12, 1e-6], np.geomspace(1e-3, 1e4, 1500), np.linspace(0.0, 20.0, 2001)])
    t32 = np.asarray(np.asarray(t, np.float32), np.float64)  # the float32 arguments, exactly
    for top in range(MAX_ORDER + 1):
        with jax.enable_x64(True):
            family64 = boys_family(top, jnp.asarray(t))
        family32 = boys_family(top, jnp.asarray(t, jnp.float32))
        for m in range(top + 1):
            np.testing.assert_allclose(np.asarray(family64[m]), boys_reference(m, t), rtol=1e-11, atol=0)  # 1.4e-12 seen
            # float32: measured worst 6.8e-7 for m <= 8 (the ERIs of d shells), 9.2e-7 up to 16;
            # F_m below 1e-30 underflows towards float32's denormals and is compared absolutely
            assert family32[m].dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(family32[m]), boys_reference(m, t32), rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="order 17 outside"):
        boys(17, 1.0)


def test_float32_boys_values_carry_no_bias():
    """Over 10^6 arguments T in [0, 30), the compiled float32 family's mean relative error against the
    float64 one is below 6e-9 for every m <= 8 (measured at most 3.5e-9, on the upward branch).
    Summed largest term first, with reciprocal constants rounded once, the float32 series and
    recursions ran 0.7-2e-8 low on average, and a bias that size in every ERI moves E_J by about
    0.1 meV. Compiled, as the kernels run it: the constants' split products need fused
    multiply-adds."""
    t = np.random.default_rng(0).uniform(0.0, 30.0, 1_000_000).astype(np.float32)
    top = 8
    family = jax.jit(lambda a: boys_family(top, a))
    family32 = family(jnp.asarray(t))
    with jax.enable_x64(True):
        family64 = family(jnp.asarray(t, jnp.float64))
    for m in range(top + 1):
        exact = np.asarray(family64[m])
        bias = np.mean((np.asarray(family32[m], np.float64) - exact) / exact)
        assert abs(bias) < 6e-9, (m, bias)


def test_a_constant_split_scales_without_bias():
    """Compiled, ``scaled`` multiplies by a float64 constant in float32 with no common error: over 10^6
    values its mean relative error is below 1e-10 (measured 1e-11), where the constant rounded to
    float32 (the plain product) scales every value by the same -3.4e-8 (2 pi^(5/2))."""
    from pyscf_ipu.integrals.boys import scaled

    x = np.random.default_rng(1).uniform(0.5, 1.5, 1_000_000).astype(np.float32)
    exact = x.astype(np.float64) * (2.0 * np.pi**2.5)
    split = np.asarray(jax.jit(lambda a: scaled(a, 2.0 * np.pi**2.5))(x), np.float64)
    plain = np.asarray(jax.jit(lambda a: a * (2.0 * np.pi**2.5))(x), np.float64)
    assert abs(np.mean((split - exact) / exact)) < 1e-10
    assert np.mean((plain - exact) / exact) < -3e-8  # what the split removes


def test_boys_gradient_is_finite_and_right():
    with jax.enable_x64(True):
        t = jnp.asarray([0.0, 0.3, 0.5, 0.7, 10.0, 59.9, 80.0])
        grad = jax.vmap(jax.grad(lambda x: boys(2, x)))(t)
        np.testing.assert_allclose(np.asarray(grad), -boys_reference(3, np.asarray(t)), rtol=1e-10)  # dF_m/dT = -F_{m+1}


@pytest.mark.parametrize("order", [1, 4])
def test_hermite_coulomb_integrals_are_derivatives_of_the_boys_function(order):
    """R_tuv(p, P - C) = d^t/dX^t d^u/dY^u d^v/dZ^v F_0(p |P - C|^2) (Helgaker, Jorgensen and Olsen,
    9.9.13): both recursions (unrolled per element, and whole arrays) against forward-mode
    derivatives of F_0, in float64. Measured: 1e-15 of the largest at order 4; bound 1e-10."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        p = jnp.asarray(rng.uniform(0.2, 3.0, 5))
        pc = [jnp.asarray(rng.uniform(-1.5, 1.5, 5)) for _ in range(3)]

        def derivative(t, u, v):
            f = lambda x, y, z: boys(0, p * (x * x + y * y + z * z))  # noqa: E731
            for axis, count in enumerate((t, u, v)):
                for _ in range(count):
                    f = partial(lambda g, axis, *xyz: jax.jvp(lambda w: g(*(w if k == axis else c for k, c in
                                                                             enumerate(xyz))), (xyz[axis],),
                                                              (jnp.ones_like(xyz[axis]),))[1], f, axis)  # fmt: skip
            return f(*pc)

        indices = hermite_indices(order)
        expected = np.stack([np.asarray(derivative(*h)) for h in indices])
        unrolled = hermite_coulomb(order, p, pc)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(np.stack([np.broadcast_to(unrolled[h], (5,)) for h in indices]), expected,
                                   atol=1e-10 * scale)  # fmt: skip
        np.testing.assert_allclose(np.asarray(hermite_coulomb_stacked(order, p, pc)), expected, atol=1e-10 * scale)


def test_cartesian_order_is_pyscfs():
    assert cartesian_powers(2) == [(2, 0, 0), (1, 1, 0), (1, 0, 1), (0, 2, 0), (0, 1, 1), (0, 0, 2)]


CI_CASES = {("water", "sto-3g"), ("water", "6-31g"), ("water", "6-31g*"), ("qm9-21989", "6-31g*")}
CASES = [pytest.param(name, basis, marks=() if (name, basis) in CI_CASES else pytest.mark.slow)
         for name in MOLECULES for basis in ("sto-3g", "6-31g", "6-31g*")]  # fmt: skip


@pytest.mark.parametrize("name, basis_name", CASES)
def test_one_electron_integrals_match_libcint(name, basis_name):
    """Overlap, kinetic energy and nuclear attraction in float64 within 1e-10 of libcint's."""
    mol = build_mole(MOLECULES[name](), basis_name)
    basis = primitive_basis(mol)
    refs = {"overlap": mol.intor("int1e_ovlp"), "kinetic": mol.intor("int1e_kin"), "nuclear": mol.intor("int1e_nuc")}
    with jax.enable_x64(True):
        ours = jax.jit(lambda coords: one_electron_at(basis, coords))(jnp.asarray(basis.coords))
    for key, ref in refs.items():
        np.testing.assert_allclose(np.asarray(ours[key]), ref, rtol=0, atol=1e-10, err_msg=key)


def test_unsupported_shells_are_refused():
    with pytest.raises(ValueError, match="only s, p, d and f shells"):
        primitive_basis(gto.M(atom="C 0 0 0; O 0 0 1.2", basis="cc-pvqz"))


@pytest.mark.parametrize("name, basis_name", [("water", "6-31g*"), ("benzene", "sto-3g"), ("qm9-21989", "6-31g*")])
def test_ao_values_and_gradients_match_pyscf(name, basis_name):
    """(4, G, N) values and gradients against PySCF's eval_ao(deriv=1) on PySCF's own grid."""
    from pyscf import dft

    from pyscf_ipu.integrals.ao_values import ao_kernel, ao_tables, constants

    mol = build_mole(MOLECULES[name](), basis_name)
    grids = dft.gen_grid.Grids(mol)
    grids.level = 0
    grids.build(sort_grids=False)
    coords, owners = grids.coords[::7], np.maximum(grids.atm_idx[::7], 0)  # every 7th point; -1 is padding
    ref = dft.numint.eval_ao(mol, coords, deriv=1)
    basis = primitive_basis(mol)

    def ours(dtype):  # the points as offsets from their own atoms, the AO centres from each atom: float64, rounded once
        tables = ao_tables(basis)
        offsets = coords - basis.coords[owners]
        shifts = basis.coords[:, None, :] - basis.coords[tables.atom][None, :, :]  # (natm, Nc, 3)
        table = constants(tables)._cast(lambda a: jnp.asarray(a, dtype))
        return np.asarray(jax.jit(ao_kernel)(table, jnp.asarray(offsets, dtype), jnp.asarray(shifts, dtype), owners,
                                             np.ones(len(coords), bool)))  # fmt: skip

    with jax.enable_x64(True):
        np.testing.assert_allclose(ours(jnp.float64), ref, rtol=0, atol=1e-12)
    ours32 = ours(jnp.float32).astype(np.float64)
    error = np.abs(ours32 - ref) / np.maximum(1.0, np.abs(ref))
    assert error.max() <= 3e-6, error.max()  # float32 round-off (measured up to 1.5e-6 on whole grids)



def test_ao_values_in_blocks_equal_the_whole_grids():
    """``ao_kernel_in_blocks`` (the assembly's) writes each block of points with the kernel itself, so
    its (4, G, N) equals the kernel's over the whole grid exactly, over several blocks and a last one;
    a grid within its block size is one block, the kernel itself."""
    from pyscf import dft

    from pyscf_ipu.integrals.ao_values import ao_kernel, ao_kernel_in_blocks, ao_tables, constants

    mol = build_mole(MOLECULES["water"](), "6-31g*")
    grids = dft.gen_grid.Grids(mol)
    grids.level = 0
    grids.build(sort_grids=False)
    points, block = 3 * 4096, 4096
    coords = np.resize(grids.coords, (points, 3))
    owners = np.resize(np.maximum(grids.atm_idx, 0), points)
    basis = primitive_basis(mol)
    tables = ao_tables(basis)
    args = (constants(tables)._cast(lambda a: jnp.asarray(a, jnp.float32)),
            jnp.asarray(coords - basis.coords[owners], jnp.float32),
            jnp.asarray(basis.coords[:, None, :] - basis.coords[tables.atom][None, :, :], jnp.float32), owners,
            np.arange(points) % 5 != 0)  # every fifth point padding  # fmt: skip
    in_blocks = partial(ao_kernel_in_blocks, most_values=block * len(tables.atom))  # three blocks
    whole, blocked = (np.asarray(jax.jit(kernel)(*args)) for kernel in (ao_kernel, in_blocks))
    np.testing.assert_array_equal(blocked, whole)
    lowered = jax.jit(in_blocks).lower(*args).as_text()
    assert "while" in lowered and "while" not in jax.jit(ao_kernel_in_blocks).lower(*args).as_text()
    assert np.abs(whole).max() > 1.0 and not whole[:, ::5].any()

ERI_CI_CASES = {("water", "sto-3g"), ("qm9-21989", "sto-3g")}
ERI_CASES = [pytest.param(name, basis, marks=() if (name, basis) in ERI_CI_CASES else pytest.mark.slow)
             for name in MOLECULES for basis in ("sto-3g", "6-31g", "6-31g*")]  # fmt: skip
ERI_CASES.append(pytest.param("carbon monoxide", "6-31g* sp and d"))  # d shells, in every run


def eri_mole(name: str, basis_name: str) -> gto.Mole:
    """The molecule of an ERI case. "6-31g* sp and d" keeps of 6-31G* only each atom's 2sp shell (three
    primitives) and its d shell: d shells in every position of a quartet in 6 classes, where the whole
    basis has 55 (carbon monoxide) to 231 (benzene), each taking seconds to compile on a CPU."""
    if basis_name != "6-31g* sp and d":
        return build_mole(MOLECULES[name](), basis_name)
    basis = {element: [gto.load("6-31g*", element)[k] for k in (1, 3, 5)] for element in "CO"}
    return gto.M(atom="C 0 0 0; O 0.1 -0.2 2.13", unit="Bohr", basis=basis, verbose=0)


@pytest.mark.parametrize("name, basis_name", ERI_CASES)
def test_eris_match_libcint(name, basis_name):
    """The packed s8 ERIs against ``mol.intor("int2e", aosym="s8")``: float64 within 1e-10 and float32
    within 1e-6 absolute, the bounds of docs/science.md (measured: 2e-14 and 2.3e-7; the one-centre integrals,
    the largest, come from libcint in float64 and are only rounded to float32)."""
    # Each case compiles a plan of its own, and a 6-31G* plan's code takes ~16,000 memory mappings
    # (benzene: 231 classes); kept alive in the jit caches, a few of them passed the kernel's
    # 65,530 per process, and LLVM's allocation failed (SIGABRT). So each case starts from none.
    jax.clear_caches()
    mol = eri_mole(name, basis_name)
    plan = plan_eri(mol)
    ref = mol.intor("int2e", aosym="s8")
    with jax.enable_x64(True):
        ours64 = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float64)[0])
    assert ours64.shape == ref.shape
    np.testing.assert_allclose(ours64, ref, rtol=0, atol=1e-10)
    del ours64
    ours32 = eri_s8(plan, mol.atom_coords()[None], jnp.float32)[0]
    assert ours32.dtype == jnp.float32
    error = np.abs(np.asarray(ours32, np.float64) - ref)
    print(f"{name}/{basis_name}: {ref.size:,} ERIs, float32 max error {error.max():.2e}")
    assert error.max() <= 1e-6


def test_eris_of_a_batch_of_conformers_match_each_geometry():
    """(C, natm, 3) positions give (C, size), each equal to libcint at that geometry (one compiled batch)."""
    mol = build_mole(MOLECULES["water"](), "sto-3g")
    plan = plan_eri(mol)
    coords = mol.atom_coords()[None] + np.random.default_rng(1).normal(scale=0.1, size=(3, mol.natm, 3))
    with jax.enable_x64(True):
        batch = np.asarray(eri_s8(plan, coords, jnp.float64))
    for c in range(3):
        ref = mol.set_geom_(coords[c], unit="Bohr", inplace=False).intor("int2e", aosym="s8")
        np.testing.assert_allclose(batch[c], ref, rtol=0, atol=1e-10)
    assert np.abs(batch[0] - batch[1]).max() > 1e-3  # the geometries really differ


def test_functions_sharing_exponents_form_one_eri_shell():
    """The ERI kernels take the functions of one atom with the same exponents as one shell (Pople's
    sp shells, a general contraction's functions), so a quartet's primitive work serves them all;
    every AO still belongs to exactly one shell component."""
    from pyscf_ipu.integrals.eri_plan import shells_of, spherical_count

    water = build_mole(MOLECULES["water"](), "6-31g")
    shells = shells_of(water)
    # O: 1s (6 primitives), 2sp (3), 3sp (1); each H: 1s (3), 2s (1)
    assert shells.components == ((0,), (0, 1), (0, 1), (0,), (0,), (0,), (0,))
    assert shells.nprim.tolist() == [6, 3, 1, 3, 1, 3, 1]
    # N2 with cc-pVDZ's general contraction of nitrogen's s functions and its first p shell only:
    # the whole basis would have 120 quartet classes, each compiled
    nitrogen = gto.load("cc-pvdz", "N")
    general = gto.M(atom="N 0 0 0; N 0 0 2.07", unit="Bohr", basis={"N": [nitrogen[0], nitrogen[2]]}, verbose=0)
    assert shells_of(general).components[0] == (0, 0)  # N's two s functions of one general contraction
    for mol in (water, general):
        shells = shells_of(mol)
        aos = [shells.offset[s, c] + k for s, comps in enumerate(shells.components)
               for c, l in enumerate(comps) for k in range(2 * l + 1)]  # fmt: skip
        assert sorted(aos) == list(range(mol.nao)), mol.basis
        assert sum(spherical_count(c) for c in shells.components) == mol.nao
    with jax.enable_x64(True):  # the general contraction's values, against libcint
        ours = np.asarray(eri_s8(plan_eri(general), general.atom_coords()[None], jnp.float64)[0])
    np.testing.assert_allclose(ours, general.intor("int2e", aosym="s8"), rtol=0, atol=1e-10)


def test_eri_workers_share_the_tiles_exactly():
    """Dealt out to worker threads, every tile of every class is computed once, and the result is
    the single program's to the bit (each share writes only its own quartets)."""
    from pyscf_ipu.integrals.eri import _parts
    from pyscf_ipu.integrals.eri_plan import NOWHERE

    mol = build_mole(MOLECULES["qm9-21989"](), "sto-3g")
    plan = plan_eri(mol)
    for workers in (2, 3):
        parts = _parts(plan, workers)
        for q in plan.quartets:
            shares = [(r, own) for part in parts for r, own in zip(part.quartets, part.dealt)
                      if (r.bra, r.ket) == (q.bra, q.ket)]  # fmt: skip
            assert len(shares) == workers and len({r.chunks.shape for r, _ in shares}) == 1  # one program for all
            # the padding tiles are no share's own and have no values; every tile is dealt exactly once
            assert not any(r.keep[~own].any() for r, own in shares)
            real = [r.chunks[own] for r, own in shares]
            assert sorted(map(tuple, np.concatenate(real))) == sorted(map(tuple, q.chunks))
        dealt = np.concatenate([part.one_centre_index for part in parts])
        assert sorted(dealt[dealt != NOWHERE]) == sorted(plan.one_centre_index)
    coords = mol.atom_coords()[None] + np.random.default_rng(2).normal(scale=0.05, size=(2, mol.natm, 3))
    one = np.asarray(eri_s8(plan, coords, workers=1))
    np.testing.assert_array_equal(np.asarray(eri_s8(plan, coords, workers=2)), one)
    np.testing.assert_array_equal(np.asarray(eri_s8(plan, coords[:1], workers=3)), one[:1])


def test_molecules_of_similar_size_share_the_compiled_integral_programs():
    """ERI plans are padded to bucketed shapes (pair rows, tiles per class, atoms, shells, the s8
    size), so two different molecules in one bucket run the same compiled programs, each still equal
    to libcint."""
    from pyscf_ipu.integrals.eri import static_tables
    from pyscf_ipu.integrals.eri_kernels import quartet_program

    first, second = (build_mole(record.molecule, "sto-3g") for record in qm9_molecules([2, 3]))  # NH3, H2O
    plans = [plan_eri(first), plan_eri(second)]
    assert plans[0].size != plans[1].size and plans[0].natm != plans[1].natm  # different molecules
    assert static_tables(plans[0]) == static_tables(plans[1])
    compiled = []
    for mol, plan in zip((first, second), plans):
        ours = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float32, workers=2)[0], np.float64)
        assert np.abs(ours - mol.intor("int2e", aosym="s8")).max() <= 1e-6
        compiled.append(quartet_program.signatures)
    assert compiled[1] == compiled[0]  # the second molecule compiled nothing new


def test_a_plan_may_compute_at_a_wider_templates_counts():
    """``eri_capacity(mol, wider)``: water's s8 layout at the counts of a molecule with four more
    hydrogens, so both run one compiled program. The wider plan's extra pair rows and chunks are
    padding, skipped at run time: the ERIs are the narrow plan's, to the bit, and libcint's."""
    from pyscf_ipu.integrals.eri import eri_shares, static_tables
    from pyscf_ipu.integrals.eri_plan import eri_capacity
    from pyscf_ipu.pyscf_mole import placeholder_mole

    water = build_mole(MOLECULES["water"](), "sto-3g")
    wider = placeholder_mole("sto-3g", ("O",) + ("H",) * 6)
    widened, own = plan_eri(water, eri_capacity(water, wider)), plan_eri(wider, eri_capacity(wider))
    assert widened.size == plan_eri(water, eri_capacity(water)).size < own.size  # water's own layout
    assert static_tables(widened) == static_tables(own)  # one program: the same classes, counts and length
    shapes = lambda plan: [a.shape for a in jax.tree.leaves(eri_shares(plan, 2))]  # noqa: E731
    assert shapes(widened) == shapes(own)
    coords = water.atom_coords()[None]
    ours = np.asarray(eri_s8(widened, coords, jnp.float32, workers=2)[0])
    np.testing.assert_array_equal(ours, np.asarray(eri_s8(plan_eri(water, eri_capacity(water)), coords,
                                                          jnp.float32, workers=2)[0]))  # fmt: skip
    assert np.abs(ours.astype(np.float64) - water.intor("int2e", aosym="s8")).max() <= 1e-6
    with pytest.raises(ValueError, match="pair classes and atoms"):  # a wider molecule lacking oxygen's kind
        eri_capacity(water, placeholder_mole("sto-3g", ("H",) * 6))


def test_an_accelerators_map_computes_a_batchs_conformers_together(monkeypatch):
    """Where an accelerator's memory allows (its size monkeypatched here), the quartet program computes
    the batch's conformers together (``lax.map``'s batch_size, whose vmapped ``cond`` computes the
    skipped chunks too and drops them): the ERIs of one conformer after another."""
    from pyscf_ipu import programs

    mol = build_mole(MOLECULES["water"](), "sto-3g")
    plan = plan_eri(mol)
    coords = mol.atom_coords()[None] + np.random.default_rng(4).normal(scale=0.05, size=(3, mol.natm, 3))
    one_by_one = np.asarray(eri_s8(plan, coords, workers=1))
    assert programs.members_at_once(3, 1) == 1  # a CPU: one after another
    monkeypatch.setattr(programs, "device_memory_bytes", lambda: 1 << 40)
    assert programs.members_at_once(3, 1 << 20) == 3 and programs.members_at_once(3, 100 << 30) == 2
    assert programs.members_at_once(3, 1 << 42) == 1
    together = np.asarray(eri_s8(plan, coords, workers=1))
    # float32 rounding: measured at most one ulp of an element (9.3e-10 on one of 1,218), bound at two
    np.testing.assert_allclose(together, one_by_one, rtol=2 * np.finfo(np.float32).eps, atol=1e-12)


def test_compiled_eri_programs_are_released_before_the_memory_mapping_limit(monkeypatch):
    """A new ERI shape, with the process past its share of ``vm.max_map_count``, first empties the
    quartet kernels' caches (which gives their memory mappings back): here a share of 0, so only the
    newest program stays compiled, and the values stay right."""
    from pyscf_ipu.integrals.eri import static_tables
    from pyscf_ipu.integrals.eri_kernels import quartet_program
    from pyscf_ipu.programs import MappingBudget, memory_mappings

    used, limit = memory_mappings()  # Linux: read from /proc
    assert 0 < used < limit
    monkeypatch.setattr(quartet_program, "budget", MappingBudget(share=0.0))
    mols = [build_mole(MOLECULES[name](), "sto-3g") for name in ("water", "benzene")]
    plans = [plan_eri(mol) for mol in mols]
    assert static_tables(plans[0]) != static_tables(plans[1])  # two programs
    for mol, plan in zip(mols, plans):
        ours = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float32, workers=1)[0], np.float64)
        assert np.abs(ours - mol.intor("int2e", aosym="s8")).max() <= 1e-6
        assert quartet_program.signatures == 1  # the other program was released


def test_eri_input_is_checked():
    mol = build_mole(MOLECULES["water"](), "sto-3g")
    plan = plan_eri(mol)
    with pytest.raises(ValueError, match="expected"):
        eri_s8(plan, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="workers = 0"):
        eri_s8(plan, mol.atom_coords()[None], workers=0)
    with pytest.raises(ValueError, match="only s, p, d and f shells"):
        plan_eri(gto.M(atom="C 0 0 0; O 0 0 1.2", basis="cc-pvqz"))


@pytest.mark.parametrize("name, basis_name", [("water", "sto-3g"), ("carbon monoxide", "6-31g* sp and d"),
                                             pytest.param("water", "6-31g*", marks=pytest.mark.slow)])
def test_long_range_eris_match_libcint(name, basis_name):
    """The s8 ERIs of erf(ω r)/r (ω = 0.3, ωB97X's) against libcint's under ``mol.with_range_coulomb``:
    float64 within 1e-10 and float32 within 1e-6, the Coulomb ERIs' bounds (measured on water's 6-31G*
    and the d shells in every quartet position: 5.5e-15 and 8.9e-8). The operator really changed."""
    jax.clear_caches()
    mol = eri_mole(name, basis_name)
    plan = plan_eri(mol, omega=0.3)
    with mol.with_range_coulomb(0.3):
        ref = mol.intor("int2e", aosym="s8")
    with jax.enable_x64(True):
        ours64 = np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float64)[0])
    error64 = np.abs(ours64 - ref).max()
    error32 = np.abs(np.asarray(eri_s8(plan, mol.atom_coords()[None], jnp.float32)[0], np.float64) - ref).max()
    print(f"{name}/{basis_name} long-range: float64 {error64:.1e}, float32 {error32:.1e}")
    assert error64 <= 1e-10 and error32 <= 1e-6
    assert np.abs(ref - mol.intor("int2e", aosym="s8")).max() > 0.1  # the operator really changed


def test_a_negative_range_separation_is_refused():
    with pytest.raises(ValueError, match="omega = -0.3"):
        plan_eri(build_mole(MOLECULES["water"](), "sto-3g"), omega=-0.3)
