"""The JAX integral source: a batch's integrals, grid, AO values and guess assembled on the device from
its size bucket's template (pyscf_ipu.templates, pyscf_ipu.assembly), against libcint and PySCF, conformer
by conformer, in each molecule's own AO order.

Tolerances (docs/science.md): float64 quantities within 1e-10 (round-off is ~1e-13); float32 ERIs
within 1e-6 absolute; float32 AO values within 3e-6 relative to max(1, |value|)
(tests/test_integrals.py). Grid weights within 1e-12 relative of PySCF's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from pyscf import ao2mo, dft, scf

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.integral_sources import DeviceFactor, JaxIntegrals, LibcintFactor, placement
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import from_atom_string, from_name
from pyscf_ipu.pyscf_mole import build_mole
from pyscf_ipu.templates import bucket_template

AMMONIA = "N 0 0 0.12; H 0 0.94 -0.27; H 0.81 -0.47 -0.27; H -0.81 -0.47 -0.27"
METHANE = "C 0 0 0; H 0.63 0.63 0.63; H -0.63 -0.63 0.63; H -0.63 0.63 -0.63; H 0.63 -0.63 -0.63"


def assembled(molecules, config: RKSConfig, source: JaxIntegrals = JaxIntegrals()):
    """(the batch's integrals as numpy arrays, its members, its bucket) from the JAX source."""
    method = resolve(config)
    bucket = resolve(config).bucket(molecules[0])
    integrals, members, _ = source.integrals(molecules, bucket, method)
    return jax.device_get(integrals), members, bucket


def template_points(bucket: SizeBucket, molecule) -> tuple[np.ndarray, np.ndarray]:
    """(points (Gp, 3) Bohr, whether each is one of the molecule's own) of the template's grid, as the
    assembly lays them out: each slot's atomic grid about its atom."""
    rows, atoms = bucket.place(molecule.symbols)
    template = bucket_template(bucket)
    tables = template.tables(frozenset(molecule.symbols))
    slots, places = template.point_rows.slot, template.point_rows.local
    coords = np.concatenate([molecule.positions, np.zeros((1, 3))])[atoms]
    return coords[slots] + tables.grid_offsets[rows[slots], places], tables.grid_volumes[rows[slots], places] != 0


@pytest.mark.parametrize("basis, eris, name", [
    ("sto-3g", "float64 float32", "water"), ("6-31g*", "fitted", "water"),
    pytest.param("6-31g*", "float64", "carbon monoxide", marks=pytest.mark.slow),
    pytest.param("6-31g*", "float64 float32", "water", marks=pytest.mark.slow)])  # fmt: skip
def test_assembled_integrals_equal_libcints_at_each_geometry(basis, eris, name):
    """Two conformers of a molecule (water: STO-3G's hydrogen capacity of 4 leaves two slots absent;
    6-31G* has d shells, through the spherical transform) and, at STO-3G, ammonia and methane in one
    batch: each conformer's overlap, core Hamiltonian and nuclear repulsion within 1e-10 of libcint's,
    its guess PySCF's atom guess, its float64 ERIs within 1e-12 (measured 1e-14) and float32 ones
    within 1e-6 (tests/test_integrals.py), its grid's points and weights PySCF's, its AO values
    PySCF's ``eval_ao``; the padded AOs' rows, columns and ERIs are zero. At 6-31G* every run takes
    water density fitted (libcint's factor, placed): its d shells' one-electron integrals, grid and AO
    values. The device's 6-31G* ERIs (carbon monoxide's 55 quartet classes, water's 176) take minutes
    to compile, so they run with --slow; tests/test_integrals.py checks the d shells' ERI kernels on a
    smaller basis in every run."""
    molecule = from_name("water") if name == "water" else from_atom_string("C 0 0 0; O 0 0 1.13")
    rng = np.random.default_rng(3)
    shape = molecule.positions.shape
    conformers = [molecule.with_positions(molecule.positions + 0.1 * rng.normal(size=shape)) for _ in range(2)]
    groups = [conformers] + ([[from_atom_string(AMMONIA), from_atom_string(METHANE)]] if basis == "sto-3g" else [])
    fitted = eris == "fitted"
    config = RKSConfig(basis=basis, jk="df") if fitted else RKSConfig(basis=basis)
    source = JaxIntegrals(factor=LibcintFactor()) if fitted else JaxIntegrals()
    for molecules in groups:
        ints, members, bucket = assembled(molecules, config, source)
        if "float32" in eris:
            float32_eris = assembled(molecules, config, JaxIntegrals(eri_precision="float32"))[0].eris
        npad = bucket.nao_padded
        for c, (molecule, member) in enumerate(zip(molecules, members)):
            mol = build_mole(molecule, basis)
            own = np.ix_(member.aos, member.aos)
            np.testing.assert_allclose(ints.overlap[c][own], mol.intor("int1e_ovlp"), rtol=0, atol=1e-10)
            np.testing.assert_allclose(ints.hcore[c][own], mol.intor("int1e_kin") + mol.intor("int1e_nuc"), rtol=0,
                                       atol=1e-10)  # fmt: skip
            np.testing.assert_allclose(ints.guess[c][own], scf.hf.init_guess_by_atom(mol), rtol=0, atol=1e-12)
            assert float(ints.nuclear_repulsion[c]) == pytest.approx(mol.energy_nuc(), abs=1e-10)
            padded = ~ints.real[c]
            assert padded.sum() == npad - mol.nao and not ints.overlap[c][padded].any() and not ints.hcore[c][padded].any()
            if not fitted:  # the fitted factor: test_the_factor_in_the_templates_pairs_equals_libcints
                eri = ao2mo.restore(1, np.asarray(ints.eris[c], np.float64), npad)
                np.testing.assert_allclose(eri[np.ix_(*[member.aos] * 4)], mol.intor("int2e"), rtol=0, atol=1e-12)
                assert not eri[padded].any()
            if "float32" in eris:
                rounded = ao2mo.restore(1, np.asarray(float32_eris[c], np.float64), npad)
                np.testing.assert_allclose(rounded[np.ix_(*[member.aos] * 4)], mol.intor("int2e"), rtol=0, atol=1e-6)
            # the grid: PySCF's points and weights, in another order
            points, real = template_points(bucket, molecule)
            grids = dft.gen_grid.Grids(mol)
            grids.level = 0
            grids.build(with_non0tab=False, sort_grids=False)
            ours = np.column_stack([points[real], ints.weights[c][real]])
            theirs = np.column_stack([grids.coords, grids.weights])[grids.atm_idx >= 0]  # its alignment padding aside
            ours, theirs = (a[np.lexsort(a[:, :3].T)] for a in (ours, theirs))
            np.testing.assert_allclose(ours[:, :3], theirs[:, :3], rtol=0, atol=1e-12)
            np.testing.assert_allclose(ours[:, 3], theirs[:, 3], rtol=1e-12, atol=1e-12)
            assert not ints.weights[c][~real].any()
            reference = dft.numint.eval_ao(mol, points[real], deriv=1)
            values = np.asarray(ints.ao[c], np.float64)
            error = np.abs(values[:, real][:, :, member.aos] - reference) / np.maximum(1.0, np.abs(reference))
            assert error.max() <= 3e-6, error.max()
            assert not values[:, ~real].any() and not values[:, :, padded].any()
        assert np.abs(ints.overlap[0] - ints.overlap[1]).max() > 1e-3  # each conformer its own


def test_a_molecules_place_in_its_bucket():
    """Each kind's atoms fill that kind's first slots in the molecule's order; the rest are absent, and
    a molecule's AOs map one to one onto the template's AOs of its atoms' slots."""
    methane, ammonia = from_atom_string(METHANE), from_atom_string(AMMONIA)
    bucket = SizeBucket.of(methane, "sto-3g", 0)
    assert bucket == SizeBucket.of(ammonia, "sto-3g", 0) and bucket.template_elements == ("H",) * 4 + ("Li",)
    rows, atoms, aos, points = placement(bucket, ammonia.symbols, True)
    assert list(atoms) == [1, 2, 3, -1, 0] and [bucket.elements[r] for r in rows] == ["H", "H", "H", "", "N"]
    assert sorted(aos) == [0, 1, 2, 4, 5, 6, 7, 8] and list(aos[:5]) == [4, 5, 6, 7, 8]  # N's 1s, 2s, 2p first
    grids = dft.gen_grid.Grids(build_mole(ammonia, "sto-3g"))
    grids.level = 0
    grids.build(with_non0tab=False, sort_grids=False)
    assert points == np.count_nonzero(grids.atm_idx >= 0)  # PySCF's grid, its alignment padding aside


@pytest.mark.parametrize("factor, spare", [(DeviceFactor(), False), (LibcintFactor(), False), (LibcintFactor(), True)],
                         ids=["jax", "libcint-in-place", "libcint-placed"])
def test_the_factor_in_the_templates_pairs_equals_libcints(factor, spare):
    """The density-fitted factor, from the JAX kernels (float64, on the device) or from libcint placed
    in the template's pairs, gives libcint's fitted ERIs B^T B (water at 6-31G*, its hydrogen first,
    so that its atoms' order is not the slots'; its own pairs in the template's order): within 1e-10
    on entries of O(1) (measured 8e-14 from the kernels, 3e-15 placed). libcint writes a molecule that
    fills its template straight into the batch's buffer, and one with a ``spare`` slot (a bucket of
    four hydrogens) is placed column run by column run. The loop's copy is the same rounded to float32."""
    from pyscf_ipu.integral_sources import template_pairs
    from pyscf_ipu.prepare import fitted_eri

    molecule = from_atom_string("H 0 0.76 -0.47; O 0 0 0.12; H 0 -0.76 -0.47")
    config = RKSConfig(basis="6-31g*", jk="df", integrals="jax")
    if spare:
        bucket = resolve(config).bucket_of(("H", "O", "H", "H"), 1)
        integrals, (member,), _ = JaxIntegrals(factor=factor).integrals([molecule], bucket, resolve(config))
        ints = jax.device_get(integrals)
    else:
        ints, (member,), bucket = assembled([molecule], config, JaxIntegrals(factor=factor))
    assert (len(template_pairs(member.aos)) < ints.eris.exact.shape[2]) == spare
    ours = np.asarray(ints.eris.exact[0])[:, template_pairs(member.aos)]  # (Qp, npair) of the molecule's pairs
    theirs = fitted_eri(build_mole(molecule, "6-31g*"), "6-31g*")
    assert ours.dtype == np.float64 and ours.shape[0] >= theirs.shape[0]
    np.testing.assert_allclose(ours.T @ ours, theirs.T @ theirs, rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(ints.eris.packed[0], np.float64), np.asarray(ints.eris.exact[0]),
                               rtol=1e-6, atol=1e-7)  # the loop's: the same, rounded to float32  # fmt: skip


@pytest.mark.parametrize("integrals", ["jax", "auto"])
def test_the_finalisation_contracts_the_device_integrals_there(integrals):
    """With the JAX integrals (float64 ERIs; ``auto`` on this CPU: float32) the finalisation contracts
    J and K of the ERIs as computed on the device, in float64, and forms the labels there. Its energy
    terms equal PySCF's float64 contraction of the same integrals at the same density, within 1e-9
    Hartree (the same numbers summed in another order)."""
    from pyscf_ipu.padding import fill_batch
    from pyscf_ipu.problem import prepare_batch
    from pyscf_ipu.rks import submit_batch

    water = from_name("water")
    config = RKSConfig(integrals=integrals)
    distorted = water.with_positions(water.positions + 0.1 * np.random.default_rng(5).normal(size=(3, 3)))
    method = resolve(config)
    results = submit_batch(prepare_batch(fill_batch([water, distorted], 4), method), method).results()[:2]
    ints, members, bucket = assembled([water, distorted], config, method.integrals)
    assert ints.eris.dtype == (np.float64 if integrals == "jax" else np.float32)
    for c, (member, result) in enumerate(zip(members, results)):
        own = np.ix_(*[member.aos] * 4)
        eri = ao2mo.restore(1, np.asarray(ints.eris[c], np.float64), bucket.nao_padded)[own]
        vj, vk = scf.hf.dot_eri_dm(eri, result.density, hermi=1)
        assert result.energy_terms["coulomb"] == pytest.approx(0.5 * np.sum(result.density * vj), abs=1e-9)
        exchange = -0.25 * method.functional.hf_exchange * np.sum(result.density * vk)
        assert result.energy_terms["exact_exchange"] == pytest.approx(exchange, abs=1e-9)
        assert result.nao == 7 and result.mo_coeff.shape == (7, 7) and len(result.mo_energy) == 7
    assert abs(results[0].energy - results[1].energy) > 1e-4  # each conformer its own
