"""The acceptance matrix of the DFT core against PySCF float64 (``./test.sh --slow``; a slice of it,
:data:`CI_SLICE`, in every run of the suite).

- float64, sto-3g: water, methane, benzene and five 9-heavy-atom QM9 molecules x b3lyp, b3lyp5,
  pbe, hf: total energy within 1e-6 Hartree of tightly converged PySCF; 6-31g for a subset.
- float32 (QM1B settings, at most 20 iterations), sto-3g at grid levels 0 and 3, the same molecules
  and functionals: energy, HOMO, LUMO and gap each within 0.5 meV (tests/tolerances.py); 6-31g and 6-31g* on two QM9
  molecules. With the default J-K backend (ipu), and once with the dense reference.

Molecules of one group share padded shapes, as the dataset generator's buckets do, so each
(functional, precision, basis, grid level) compiles once.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.rks import run_rks
from pyscf_ipu.units import HARTREE_TO_MEV

from .molecules import QM9, SMALL
from .tolerances import LABEL_MEV

XCS = ["b3lyp", "b3lyp5", "pbe", "hf"]
ALL = SMALL + QM9

FLOAT64 = [(m, xc, "sto-3g") for xc in XCS for m in ALL] + [
    (m, xc, "6-31g") for xc in XCS for m in ["water", "methane", "qm9:21989"]
]
# the default J-K backend (ipu) everywhere, and the dense reference once over the molecules
FLOAT32 = (
    [(m, xc, "sto-3g", level, "ipu") for level in (0, 3) for xc in XCS for m in ALL]
    + [(m, "b3lyp", basis, 0, "ipu") for basis in ("6-31g", "6-31g*") for m in ["qm9:21989", "qm9:22032"]]
    + [(m, "b3lyp", "sto-3g", 0, "dense") for m in ALL]
)
# the float32 cases every run of the suite checks: a 9-heavy-atom molecule with PBE and with HF, and
# at grid level 3 (with the 172 AOs of test_eleven_heavy_atoms_at_631gs_with_ipu, also in every run)
CI_SLICE = [("qm9:21989", "pbe", "sto-3g", 0, "ipu"), ("qm9:21989", "hf", "sto-3g", 0, "ipu"),
            ("qm9:21989", "b3lyp5", "sto-3g", 3, "ipu")]  # fmt: skip


def _matrix(cases: list[tuple], ci: list[tuple] = ()) -> list:
    """``cases`` as parameters, each marked slow unless in ``ci``."""
    return [pytest.param(*c, id="-".join(map(str, c)), marks=() if c in ci else pytest.mark.slow) for c in cases]


@pytest.fixture
def case(host_of):
    """case(name, basis, grid_level) -> (molecule, host, padded sizes shared by its group)."""

    def get(name, basis, grid_level):
        host = host_of(name, basis, grid_level)
        sizes = host.bucket.shapes
        if name.startswith("qm9:") and basis == "sto-3g":  # one bucket for the QM9 set
            group = [host_of(q, basis, grid_level).bucket.shapes for q in QM9]
            sizes = tuple(int(s) for s in np.max(group, axis=0))
        return host.molecule, host, sizes

    return get


@pytest.mark.parametrize("name, xc, basis", _matrix(FLOAT64))
def test_float64_energy_within_1e6_hartree(case, reference, name, xc, basis):
    molecule, host, sizes = case(name, basis, 0)
    config = RKSConfig(xc=xc, basis=basis, precision="float64", max_iterations=60, stop_commutator=1e-9)
    result = run_rks(molecule, config, prepared=host, shapes=sizes)
    ref = reference(molecule, config)
    print(f"{name} {xc}/{basis} float64: dE {result.energy - ref.energy:+.2e} Hartree, {result.iterations} iterations")
    assert abs(result.energy - ref.energy) < 1e-6, (result.energy - ref.energy)
    assert result.converged


@pytest.mark.parametrize("name, xc, basis, grid_level, jk", _matrix(FLOAT32, CI_SLICE))
def test_float32_within_half_a_mev(case, reference, name, xc, basis, grid_level, jk):
    molecule, host, sizes = case(name, basis, grid_level)
    config = RKSConfig(xc=xc, basis=basis, grid_level=grid_level, jk=jk)  # float32, max 20 iterations
    result = run_rks(molecule, config, prepared=host, shapes=sizes)
    ref = reference(molecule, config)
    diffs = {
        "energy": result.energy - ref.energy,
        "homo": result.homo - ref.homo,
        "lumo": result.lumo - ref.lumo,
        "gap": result.gap - ref.gap,
    }
    mev = {k: round(v * HARTREE_TO_MEV, 4) for k, v in diffs.items()}
    print(f"{name} {xc}/{basis} level {grid_level} {jk}: {mev} meV, {result.iterations} iterations")
    assert max(abs(v) for v in mev.values()) < LABEL_MEV, mev
    assert result.converged and result.iterations <= 20


def test_eleven_heavy_atoms_at_631gs_with_ipu(reference):
    """More than 150 AOs end to end on the simulated IPU: no 70-AO limit; the planner spreads it. The
    integrals are libcint's: the device's 6-31G* ERI kernels take minutes to compile on a CPU, and
    tests/test_assembly.py checks them against libcint's."""
    from pyscf_ipu.molecule import from_name

    molecule = from_name("paracetamol")  # C8H9NO2: 11 heavy atoms
    config = RKSConfig(basis="6-31g*", integrals="libcint")  # float32, ipu, up to 16 IPUs
    result = run_rks(molecule, config, profile=True)
    assert result.nao == 172
    profile = result.jk_profile
    assert profile["ipus_used"] > 1 and profile["bytes_per_tile"]["max"] <= profile["bytes_per_tile"]["budget"]
    ref = reference(molecule, config)
    mev = {k: abs(a - b) * HARTREE_TO_MEV for k, a, b in [("energy", result.energy, ref.energy),
           ("homo", result.homo, ref.homo), ("lumo", result.lumo, ref.lumo), ("gap", result.gap, ref.gap)]}  # fmt: skip
    print(f"paracetamol 6-31g*: {mev} meV on {profile['ipus_used']} IPUs ({profile['strategy']})")
    assert max(mev.values()) < LABEL_MEV and result.converged


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_float32_labels_with_device_integrals_within_half_a_mev(reference, qm9_nine_heavy, name):
    """The whole SCF on the device's own integrals (pyscf_ipu.integrals, float32, assembled from the
    size bucket's template): energy, HOMO, LUMO and gap within 0.5 meV of PySCF, as with libcint's;
    B3LYP/STO-3G at grid level 0 (QM1B)."""
    from .molecules import molecule_by_name

    molecule = molecule_by_name(name, qm9_nine_heavy)
    config = RKSConfig(integrals="jax")
    result = run_rks(molecule, config)
    ref = reference(molecule, config)
    mev = {k: round((getattr(result, k) - getattr(ref, k)) * HARTREE_TO_MEV, 4)
           for k in ("energy", "homo", "lumo", "gap")}  # fmt: skip
    print(f"{name} b3lyp/sto-3g device integrals: {mev} meV, {result.iterations} iterations")
    assert max(abs(v) for v in mev.values()) < LABEL_MEV, mev
    assert result.converged and result.iterations <= 20
