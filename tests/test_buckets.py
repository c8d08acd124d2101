"""Size buckets: molecules of one bucket share every program, may share a batch, and get the labels
they get alone (stored programs: tests/test_programs.py)."""

from __future__ import annotations

import pytest

from pyscf_ipu.buckets import SizeBucket
from pyscf_ipu.config import ConfigError, RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.problem import prepare_batch
from pyscf_ipu.molecule import from_atom_string
from pyscf_ipu.rks import submit_batch

# Ammonia and methane: one heavy atom each, and 3 or 4 hydrogens (STO-3G hydrogen's capacity goes in
# steps of 4, so both have capacity 4 and share a bucket).
AMMONIA = "N 0 0 0.12; H 0 0.94 -0.27; H 0.81 -0.47 -0.27; H -0.81 -0.47 -0.27"
METHANE = "C 0 0 0; H 0.63 0.63 0.63; H -0.63 -0.63 0.63; H -0.63 0.63 -0.63; H 0.63 -0.63 -0.63"
ETHANE = ("C 0 0 0.76; C 0 0 -0.76; H 1.02 0 1.16; H -0.51 0.88 1.16; H -0.51 -0.88 1.16; H -1.02 0 -1.16; "
          "H 0.51 -0.88 -1.16; H 0.51 0.88 -1.16")


def test_buckets_count_atoms_by_kind_not_element():
    ammonia, methane = from_atom_string(AMMONIA), from_atom_string(METHANE)
    water = from_atom_string("O 0 0 0; H 0 0.76 0.59; H 0 -0.76 0.59")
    assert SizeBucket.of(ammonia, "sto-3g", 0) == SizeBucket.of(methane, "sto-3g", 0)  # N and C: one kind
    bucket = SizeBucket.of(methane, "sto-3g", 0)
    assert bucket.nao_padded == 5 + 4 and bucket.natm_padded == 5 and bucket.grid_points_padded % 1024 == 0
    assert SizeBucket.of(water, "sto-3g", 0).nao_padded == 5 + 4  # 2 H padded to the capacity 4
    assert SizeBucket.of(from_atom_string(ETHANE), "sto-3g", 0).nao_padded == 2 * 5 + 8  # 6 H: capacity 8
    assert SizeBucket.of(methane, "6-31g", 0) != bucket


def test_density_fitted_buckets_also_split_by_the_occupied_count():
    """Only density fitting's shapes depend on the occupied orbitals (K's rank), so only its buckets
    hold their count, rounded up to 8; the bound covers every molecule of the bucket."""
    ammonia, methane = from_atom_string(AMMONIA), from_atom_string(METHANE)
    step = resolve(RKSConfig(jk="df")).backend.occupied_step
    assert step == 8 and resolve(RKSConfig()).backend.occupied_step == 0
    fitted = SizeBucket.of(methane, "6-31g*", 0, step)
    assert fitted.occupied == 8 and fitted.occupied_rank == min(8, fitted.density_rank)
    assert SizeBucket.of(ammonia, "6-31g*", 0, step) == fitted  # both 5 pairs
    assert SizeBucket.of(methane, "6-31g*", 0) != fitted and SizeBucket.of(methane, "6-31g*", 0).occupied == 0
    ethane = from_atom_string(ETHANE)  # 9 pairs: the next step
    assert SizeBucket.of(ethane, "6-31g*", 0, step).occupied == 16
    # the charge counts: NH4+ has 5 pairs, as methane
    ammonium = from_atom_string(METHANE.replace("C 0", "N 0"), charge=1)
    assert SizeBucket.of(ammonium, "6-31g*", 0, step).occupied == 8
    assert fitted.label().endswith(":occ8") and ":occ" not in SizeBucket.of(methane, "6-31g*", 0).label()


def test_density_fitted_kinds_split_by_fitting_functions():
    """At 6-31G* lithium has carbon's shells but more fitting functions (83 against 70 in PySCF's
    default fitting basis): a fitted bucket gives it a kind of its own, so that carbon's atoms are not
    padded to lithium's count. Methane's padded count is then PySCF's own (its hydrogens need no
    padding), and a bucket without fitting keeps lithium and carbon in one kind."""
    from pyscf import df, gto

    def pyscf_count(molecule):  # what density_fit() fits with
        mol = gto.M(atom=list(zip(molecule.symbols, molecule.positions)), unit="bohr", basis="6-31g*",
                    charge=molecule.charge, verbose=0)  # fmt: skip
        return df.make_auxmol(mol, df.make_auxbasis(mol)).nao

    step = resolve(RKSConfig(jk="df")).backend.occupied_step
    methane = from_atom_string(METHANE)
    assert SizeBucket.of(methane, "6-31g*", 0, step).naux_padded == pyscf_count(methane) == 70 + 4 * 23
    lithium = from_atom_string(METHANE.replace("C 0", "Li 0"), charge=-3)  # LiH4(3-): methane's shape
    assert SizeBucket.of(lithium, "6-31g*", 0) == SizeBucket.of(methane, "6-31g*", 0)
    lithium_fitted = SizeBucket.of(lithium, "6-31g*", 0, step)
    assert lithium_fitted.kinds != SizeBucket.of(methane, "6-31g*", 0, step).kinds
    assert lithium_fitted.naux_padded == pyscf_count(lithium) == 83 + 4 * 23


def test_molecules_of_one_bucket_share_a_batch_and_every_program():
    """A batch mixing ammonia and methane conformers runs the programs of a batch of methane alone (the
    bucket template's: only the positions and each slot's element differ), and each conformer's
    labels equal those of a batch of its own molecule (float32 round-off)."""
    from pyscf_ipu.assembly import assemble_program
    from pyscf_ipu.integrals.eri_kernels import quartet_program
    from pyscf_ipu.scf import scf_program

    config = RKSConfig(integrals="jax")
    method = resolve(config)
    ammonia, methane = from_atom_string(AMMONIA), from_atom_string(METHANE)
    alone = [submit_batch(prepare_batch([m, m], method), method).results()[0] for m in (ammonia, methane)]
    programs = (quartet_program.signatures, scf_program.signatures, assemble_program.signatures)
    mixed = submit_batch(prepare_batch([ammonia, methane], method), method).results()
    assert (quartet_program.signatures, scf_program.signatures, assemble_program.signatures) == programs  # nothing new
    for single, member in zip(alone, mixed):
        assert member.nao == single.nao
        # float32 loops over differently padded batches: equal to well inside the 2 meV label tolerance
        assert abs(member.energy - single.energy) < 1e-6 and abs(member.gap - single.gap) < 1e-6


ETHYLENE = "C 0 0 0.67; C 0 0 -0.67; H 0 0.92 1.23; H 0 -0.92 1.23; H 0 0.92 -1.23; H 0 -0.92 -1.23"


def test_widened_buckets_round_only_the_light_kinds_further():
    ethylene, ethane = (SizeBucket.of(from_atom_string(m), "sto-3g", 0) for m in (ETHYLENE, ETHANE))
    assert ethylene != ethane and ethylene.widened(16) == ethane.widened(16)  # 4 and 8 hydrogens: 16 slots
    assert ethane.widened(16).nao_padded == 2 * 5 + 16 and ethane.widened(4) == ethane  # carbon exact
    assert SizeBucket.of(from_atom_string(METHANE), "sto-3g", 0).widened(16) != ethane.widened(16)


def test_buckets_that_differ_in_hydrogens_share_their_eri_programs():
    """On a CPU, ethylene's bucket (4 hydrogen slots) and ethane's (8) compute their ERIs at the counts
    of one wider bucket: the same static tables and array shapes, so the same compiled pair and
    quartet programs, each in its own s8 layout; ethane's labels, computed so, are PySCF's."""
    import jax

    from pyscf_ipu.integrals.eri import eri_shares, eri_structure, shared_eri_aos, static_tables
    from pyscf_ipu.reference import pyscf_reference
    from pyscf_ipu.templates import bucket_template
    from pyscf_ipu.units import HARTREE_TO_MEV

    from .tolerances import LABEL_MEV

    assert shared_eri_aos() == 16  # the suite runs on a CPU
    ethylene, ethane = from_atom_string(ETHYLENE), from_atom_string(ETHANE)
    plans = [bucket_template(SizeBucket.of(m, "sto-3g", 0)).plan for m in (ethylene, ethane)]
    assert plans[0].size < plans[1].size  # each bucket's own layout
    assert static_tables(plans[0]) == static_tables(plans[1])
    for arrays in (eri_structure, lambda plan: eri_shares(plan, 2)):
        shapes = [[a.shape for a in jax.tree.leaves(arrays(plan))] for plan in plans]
        assert shapes[0] == shapes[1]
    method = resolve(RKSConfig(integrals="jax"))
    result = submit_batch(prepare_batch([ethane], method), method).results()[0]
    reference = pyscf_reference(ethane, method)
    mev = [abs(getattr(result, k) - getattr(reference, k)) * HARTREE_TO_MEV for k in ("energy", "homo", "lumo")]
    assert max(mev) < LABEL_MEV and result.converged


def test_a_coarser_bucket_step_gives_ethylene_and_ethane_one_bucket_and_pyscfs_labels():
    """``bucket_step`` 16 (an accelerator's default; a CPU's is 4) rounds hydrogens up to 16 slots:
    ethylene (4) and ethane (6) then share a bucket, so a batch may mix them, and each conformer's
    labels, computed with 12 and 10 padded AOs, are PySCF's."""
    import jax

    from pyscf_ipu.buckets import default_bucket_step
    from pyscf_ipu.reference import pyscf_reference
    from pyscf_ipu.units import HARTREE_TO_MEV

    from .tolerances import LABEL_MEV

    assert default_bucket_step("cpu") == 4 and default_bucket_step("gpu") == 16
    assert resolve(RKSConfig()).bucket_step == default_bucket_step(jax.default_backend())
    method = resolve(RKSConfig(integrals="jax", bucket_step=16))
    ethylene, ethane = from_atom_string(ETHYLENE), from_atom_string(ETHANE)
    assert method.bucket(ethylene) == method.bucket(ethane) and method.bucket(ethane).nao_padded == 2 * 5 + 16
    results = submit_batch(prepare_batch([ethylene, ethane], method), method).results()
    for molecule, result in zip((ethylene, ethane), results):
        reference = pyscf_reference(molecule, method)
        mev = [abs(getattr(result, k) - getattr(reference, k)) * HARTREE_TO_MEV for k in ("energy", "homo", "lumo")]
        assert max(mev) < LABEL_MEV and result.converged
    with pytest.raises(ConfigError, match="--bucket-step is in AOs"):
        RKSConfig(bucket_step=0)


def test_a_batch_refuses_molecules_of_two_buckets():
    config = RKSConfig(integrals="jax")
    with pytest.raises(ValueError, match="one size bucket"):
        prepare_batch([from_atom_string(METHANE), from_atom_string(ETHANE)], resolve(config))
