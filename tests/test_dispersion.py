"""Dispersion corrections (pyscf_ipu.dispersion) in the energy and the forces: D3(BJ) against PySCF's
own ``mf.disp = "d3bj"`` and against central differences of the correction's energy; ωB97X-D's own
(Chai and Head-Gordon's) against Psi4's ``-CHG`` correction, whose energies and gradients
``scripts/make_chg_reference.py`` stored in ``tests/references/chg_psi4.json``.

Tolerances, a margin above the measured errors. The correction is the library's, so a run with it
differs from PySCF's by what the run without it does: the correction itself equal (measured 0), the
float64 energy 6.2e-11 Hartree apart (water, B3LYP), the gradients with grid response 1.5e-8
Hartree/Bohr (FORCES_FLOAT64). The correction's gradient against central differences of its energy
with a step of 1e-4 Bohr: at most 6.9e-12 Hartree/Bohr over paracetamol's 60 coordinates. Chai and
Head-Gordon's against Psi4: energies at most 1.4e-6 of themselves apart (the two programs' unit
conversions; 2.5e-8 Hartree at diazepam), gradients at most 6.6e-10 Hartree/Bohr.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.forces import nuclear_gradient
from pyscf_ipu.molecule import Molecule, MoleculeError, from_name
from pyscf_ipu.reference import pyscf_method
from pyscf_ipu.resolution import resolve
from pyscf_ipu.rks import run_rks

from .tolerances import FORCES_FLOAT64

FLOAT64 = dict(precision="float64", max_iterations=60, stop_commutator=1e-9)
FINITE_DIFFERENCE = 1e-10  # Hartree/Bohr
ENERGY_FLOAT64 = 1e-9  # Hartree
PSI4_CHG = Path(__file__).parent / "references" / "chg_psi4.json"
CHG_ENERGY_RELATIVE = 2e-6
CHG_GRADIENT = 1e-9  # Hartree/Bohr


def test_the_corrections_gradient_is_the_derivative_of_its_energy():
    """Paracetamol (20 atoms of four elements and several coordinations): central differences of
    E_disp along three coordinates."""
    molecule = from_name("paracetamol")
    method = resolve(RKSConfig(dispersion="d3bj", xc="b3lyp5"))
    dispersion, functional = method.dispersion, method.functional
    gradient = dispersion.gradient(molecule, functional, np.zeros((molecule.natom, 3)))
    assert np.abs(gradient).max() > 1e-5  # a gradient there to check
    h = 1e-4
    for atom, axis in [(0, 0), (1, 2), (molecule.natom - 1, 1)]:
        step = np.zeros_like(molecule.positions)
        step[atom, axis] = h
        energies = [dispersion.energy_terms(dataclasses.replace(molecule, positions=molecule.positions + s * step),
                                            functional)["dispersion"] for s in (1, -1)]  # fmt: skip
        difference = (energies[0] - energies[1]) / (2 * h)
        assert abs(difference - gradient[atom, axis]) < FINITE_DIFFERENCE, (atom, axis, difference, gradient[atom, axis])


def test_b3lyp_d3bj_labels_and_forces_match_pyscfs_with_the_same_correction():
    """Water in float64: the run with D3(BJ) against PySCF's RKS with ``mf.disp = "d3bj"``. The
    correction moves the energy by its own term and nothing else: the orbitals, and every other term,
    are those of the run without it (to 1e-12 Hartree: from an empty cache the first run compiles its
    programs and the second loads them, which moved an orbital energy by 1.4e-14)."""
    molecule = from_name("water")
    config = RKSConfig(dispersion="d3bj", **FLOAT64)
    plain = run_rks(molecule, dataclasses.replace(config, dispersion="none"))
    result = run_rks(molecule, config)
    assert "dispersion" not in plain.energy_terms and set(result.energy_terms) == {*plain.energy_terms, "dispersion"}
    for name, value in plain.energy_terms.items():
        assert result.energy_terms[name] == pytest.approx(value, abs=1e-12), name
    np.testing.assert_allclose(result.mo_energy, plain.mo_energy, rtol=0, atol=1e-12)
    assert result.energy - plain.energy == pytest.approx(result.energy_terms["dispersion"], abs=1e-12)

    method = resolve(config)
    mf = pyscf_method(molecule, method)
    mf.conv_tol = 1e-11
    reference = mf.kernel()
    assert mf.converged and mf.disp == "d3bj"
    assert abs(result.energy_terms["dispersion"] - float(mf.scf_summary["dispersion"])) < 1e-12
    assert abs(result.energy - reference) < ENERGY_FLOAT64
    gradient = mf.nuc_grad_method()
    gradient.grid_response = True
    ours = nuclear_gradient(molecule, result, method, grid_response=True)
    np.testing.assert_allclose(ours, gradient.kernel(), rtol=0, atol=FORCES_FLOAT64)


def test_the_device_gradients_take_the_correction():
    """The batch's device gradients (pyscf_ipu.gradients) add each conformer's correction to what the
    device program gave, in the conformer's own atom order."""
    from pyscf_ipu.gradients import _DevicePending

    method = resolve(RKSConfig(dispersion="d3bj"))
    water, benzene = from_name("water"), from_name("benzene")
    by_slot = np.arange(2 * 12 * 3, dtype=float).reshape(2, 12, 3)  # what the program gave, by slot
    slots = [np.array([2, 0, 1]), np.arange(12)[::-1]]
    pending = _DevicePending([by_slot], slots, [water, benzene], method)
    for c, (molecule, gradient) in enumerate(zip([water, benzene], pending.gradients([object(), object()]))):
        correction = method.dispersion.gradient(molecule, method.functional, np.zeros((molecule.natom, 3)))
        np.testing.assert_array_equal(gradient, by_slot[c][slots[c]] + correction)
        assert np.abs(correction).max() > 1e-6


def test_an_unknown_dispersion_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown dispersion 'd4'"):
        resolve(RKSConfig(dispersion="d4"))


def test_wb97x_d_dispersion_matches_psi4_for_every_element_and_a_drug():
    """Each element H to Xe beside a hydrogen at 4 and 8 Bohr (the damping and C_6 each decide one),
    paracetamol and an RDKit conformer of diazepam (20 heavy atoms): energy and gradient against Psi4's."""
    stored = json.loads(PSI4_CHG.read_text())
    assert stored["dashlevel"] == "chg" and stored["params"] == {"s6": 1.0}
    method = resolve(RKSConfig(xc="wb97x-d", jk="df", integrals="auto"))
    dispersion, functional = method.dispersion, method.functional
    assert dispersion.name == "chg"
    elements = set()
    for entry in stored["molecules"]:
        molecule = Molecule(np.array(entry["atomic_numbers"]), np.array(entry["positions"]))
        elements.update(entry["atomic_numbers"])
        energy = dispersion.energy_terms(molecule, functional)["dispersion"]
        gradient = dispersion.gradient(molecule, functional, np.zeros((molecule.natom, 3)))
        assert energy == pytest.approx(entry["energy"], rel=CHG_ENERGY_RELATIVE, abs=0), entry["name"]
        np.testing.assert_allclose(gradient, entry["gradient"], rtol=0, atol=CHG_GRADIENT, err_msg=entry["name"])
    assert elements == set(range(1, 55)) and len(stored["molecules"]) == 2 * 54 + 2


def test_dispersion_auto_is_the_functionals_own_and_chg_is_wb97x_ds_alone():
    assert RKSConfig(xc="wb97x-d").dispersion == "chg" and RKSConfig(xc="WB97X-D").dispersion == "chg"
    assert RKSConfig(xc="wb97x").dispersion == "none" and RKSConfig().dispersion == "none"
    assert RKSConfig(xc="wb97x-d", dispersion="none").dispersion == "none"  # asked for: the functional alone
    assert RKSConfig(xc="wb97x-d", dispersion=" AUTO").dispersion == "chg"
    with pytest.raises(ConfigError, match="--dispersion chg is ωB97X-D's own"):
        resolve(RKSConfig(xc="b3lyp", dispersion="chg"))
    method = resolve(RKSConfig(xc="wb97x-d", jk="df", integrals="auto"))
    radon_hydride = Molecule(np.array([86, 1]), np.array([[0.0, 0, 0], [0, 0, 3.0]]))
    with pytest.raises(MoleculeError, match="H to Xe only"):
        method.dispersion.energy_terms(radon_hydride, method.functional)


def test_references_add_the_correction_pyscf_lacks_and_pyscf_itself_refuses_it():
    """PySCF's counterpart of a ωB97X-D run refuses the correction PySCF lacks; what the references
    (``--check``, ``qm1b validate``, the benchmarks) run instead is the functional without it, with the
    correction's energy to add; a correction PySCF has is left to PySCF."""
    from pyscf_ipu.reference import pyscf_runnable

    molecule = from_name("water")
    method = resolve(RKSConfig(xc="wb97x-d", basis="6-31g", jk="df", integrals="auto"))
    with pytest.raises(ConfigError, match="PySCF has no Chai and Head-Gordon dispersion"):
        pyscf_method(molecule, method)
    runnable, added = pyscf_runnable(molecule, method)
    assert runnable.dispersion.name == "none" and runnable.functional is method.functional
    assert added == method.dispersion.energy_terms(molecule, method.functional)["dispersion"] < 0
    assert pyscf_method(molecule, runnable).xc == "hyb_gga_xc_wb97x_d"
    d3bj = resolve(RKSConfig(xc="b3lyp", dispersion="d3bj"))
    assert pyscf_runnable(molecule, d3bj) == (d3bj, 0.0)


def test_elements_beyond_the_corrections_tables_are_refused_before_any_work():
    """3-21G has caesium, all-electron; D2's tables end at xenon."""
    method = resolve(RKSConfig(xc="wb97x-d", basis="3-21g", jk="df", integrals="auto"))
    with pytest.raises(MoleculeError, match="H to Xe only, not Cs"):
        method.check_elements(["H", "Cs"])
    method.check_elements(["H", "Xe"])
    d3bj = resolve(RKSConfig(xc="b3lyp", basis="3-21g", dispersion="d3bj"))
    d3bj.check_elements(["H", "Cs"])
    # D3(BJ) reads the atoms alone: iodine in a basis without a core potential, as in any other
    hydrogen_iodide = Molecule(np.array([1, 53]), np.array([[0.0, 0, 0], [0, 0, 3.0]]))
    assert d3bj.dispersion.energy_terms(hydrogen_iodide, d3bj.functional)["dispersion"] < 0
