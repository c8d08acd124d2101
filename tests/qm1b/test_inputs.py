"""The generator's input side: SMILES files, the built-in sample, selection, seeds and conformers."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from rdkit import Chem

from pyscf_ipu.units import BOHR_PER_ANGSTROM
from qm1b.conformers import ConformerError, conformer_seed, embed_conformers
from qm1b.inputs import (
    InputError,
    MoleculeInput,
    builtin_sample,
    heavy_atom_count,
    parse_range,
    parse_shard,
    read_smiles,
    select,
)

from ..scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_gdb_sample.py"


# --- reading files -----------------------------------------------------------------------------

SMI_TEXT = (
    "# a header comment\n"
    "\n"
    "CCO ethanol\n"
    "C#N\thydrogen-cyanide\n"  # tab separator; '#' inside a SMILES is a triple bond, not a comment
    "   # an indented comment\n"
    "c1ccccc1\n"  # no id
    "   \n"
    "CC(=O)O  acetic acid  \r\n"  # the id is the rest of the line; CRLF line ending
)
SMI_EXPECTED = [
    MoleculeInput(0, "CCO", "ethanol"),
    MoleculeInput(1, "C#N", "hydrogen-cyanide"),
    MoleculeInput(2, "c1ccccc1", ""),
    MoleculeInput(3, "CC(=O)O", "acetic acid"),
]


@pytest.mark.parametrize("suffix", [".smi", ".txt"])
def test_smi_with_ids_comments_and_blank_lines(tmp_path, suffix):
    path = tmp_path / f"in{suffix}"
    path.write_bytes(SMI_TEXT.encode())
    assert read_smiles(path) == SMI_EXPECTED
    assert read_smiles(str(path)) == SMI_EXPECTED


def test_gzipped_smi(tmp_path):
    path = tmp_path / "gdb.smi.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(SMI_TEXT)
    assert read_smiles(path) == SMI_EXPECTED


def test_csv_with_id_column(tmp_path):
    path = tmp_path / "in.csv"
    # Case-insensitive header, extra columns, a blank row (skipped, not counted), a quoted name.
    path.write_text('Energy,SMILES,ID\n1.0,CCO,mol-a\n\n2.0,C#N,"b, quoted"\n,,\n3.0,CCN,c\n')
    assert read_smiles(path) == [
        MoleculeInput(0, "CCO", "mol-a"),
        MoleculeInput(1, "C#N", "b, quoted"),
        MoleculeInput(2, "CCN", "c"),
    ]


def test_csv_with_name_column_and_without_id(tmp_path):
    named = tmp_path / "named.csv"
    named.write_text("name,smiles\nethanol,CCO\nmethane,C\n")
    assert read_smiles(named) == [MoleculeInput(0, "CCO", "ethanol"), MoleculeInput(1, "C", "methane")]
    plain = tmp_path / "plain.csv"
    plain.write_text("\ufeffsmiles,energy\nCCO,1\nC,2\n")  # with a byte-order mark, as spreadsheets write
    assert read_smiles(plain) == [MoleculeInput(0, "CCO", ""), MoleculeInput(1, "C", "")]


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.smi"
    with pytest.raises(InputError, match="nope.smi: no such file"):
        read_smiles(path)


def test_csv_without_smiles_column_names_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("id,structure\n1,CCO\n")
    with pytest.raises(InputError) as err:
        read_smiles(path)
    assert f"{path}:1:" in str(err.value) and "smiles" in str(err.value) and "'structure'" in str(err.value)


def test_csv_empty_smiles_cell_names_line(tmp_path):
    path = tmp_path / "gap.csv"
    path.write_text("smiles,id\nCCO,a\n,b\n")
    with pytest.raises(InputError, match=rf"{path.name}:3: empty SMILES"):
        read_smiles(path)


@pytest.mark.parametrize(("name", "text"), [("empty.smi", ""), ("comments.smi", "# only\n\n  # comments\n"),
                                            ("header.csv", "smiles,id\n")])  # fmt: skip
def test_empty_input(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=rf"{name}: no SMILES found"):
        read_smiles(path)


def test_unknown_extension(tmp_path):
    path = tmp_path / "in.sdf"
    path.write_text("CCO\n")
    with pytest.raises(InputError, match=r"in\.sdf: unknown input format '\.sdf'"):
        read_smiles(path)


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


# --- the built-in sample -----------------------------------------------------------------------


def test_builtin_sample_contents():
    sample = builtin_sample()
    assert 90 <= len(sample) <= 110
    assert [m.molecule_id for m in sample] == list(range(len(sample)))
    ids = [m.name for m in sample]
    assert all(ids) and len(set(ids)) == len(ids)
    heavy = {}
    for entry in sample:
        mol = Chem.MolFromSmiles(entry.smiles)
        assert mol is not None, entry
        heavy[entry.name] = mol.GetNumHeavyAtoms()
        assert 9 <= heavy[entry.name] <= 11, entry
        assert {a.GetSymbol() for a in mol.GetAtoms()} <= {"C", "N", "O", "F"}, entry
        assert Chem.GetFormalCharge(mol) == 0 and not any(a.GetFormalCharge() for a in mol.GetAtoms()), entry
        assert sum(a.GetNumRadicalElectrons() for a in mol.GetAtoms()) == 0, entry
        assert sum(a.GetAtomicNum() for a in Chem.AddHs(mol).GetAtoms()) % 2 == 0, entry
    # 9 heavy atoms exactly for the QM9 ones, 10-11 for the hand-written ones.
    qm9 = [m for m in sample if m.name.startswith("qm9_")]
    assert len(qm9) >= 50 and all(heavy[m.name] == 9 for m in qm9)
    assert sum(heavy[m.name] == 10 for m in sample) >= 10 and sum(heavy[m.name] == 11 for m in sample) >= 10
    # A mix: hydrocarbons and heteroatom compounds (incl. fluorinated), rings and chains.
    mols = [Chem.MolFromSmiles(m.smiles) for m in qm9]
    elements = [{a.GetSymbol() for a in mol.GetAtoms()} for mol in mols]
    assert sum(e == {"C"} for e in elements) >= 5 and sum("F" in e for e in elements) >= 5
    assert sum(bool(e & {"N", "O"}) for e in elements) >= 30
    rings = [mol.GetRingInfo().NumRings() > 0 for mol in mols]
    assert sum(rings) >= 20 and sum(not r for r in rings) >= 10
    assert any(m.name == "paracetamol" and m.smiles == "CC(=O)Nc1ccc(O)cc1" for m in sample)


def test_builtin_sample_file_has_a_source_header():
    text = resources.files("qm1b").joinpath("data/gdb_sample.smi").read_text()
    first = text.splitlines()[0]
    assert first.startswith("#") and "QM9" in text.split("\n\n")[0] and "make_gdb_sample.py" in text


def test_builtin_sample_matches_the_script_hand_written_part():
    """The cheap half of reproducibility: the 10-11 heavy-atom molecules are the script's list."""
    script = load_script(SCRIPT)
    written = [(m.smiles, m.name) for m in builtin_sample() if not m.name.startswith("qm9_")]
    assert written == script.HAND_WRITTEN


@pytest.mark.slow
def test_builtin_sample_is_reproducible():
    """The script regenerates the file byte for byte (reads all of QM9: ~45 s)."""
    assert load_script(SCRIPT).main(["--check"]) == 0


def test_builtin_sample_molecules_all_embed():
    for entry in builtin_sample():
        assert len(embed_conformers(entry.smiles, 1, seed=0, molecule_id=entry.molecule_id)) == 1, entry


# --- selection ---------------------------------------------------------------------------------


def test_heavy_atom_count():
    assert heavy_atom_count("CCO") == 3
    assert heavy_atom_count("[H]C([H])([H])O") == 2  # explicit hydrogens are not heavy
    assert heavy_atom_count("CC(=O)Nc1ccc(O)cc1") == 11
    assert heavy_atom_count("C1CC") is None


def _inputs(smiles: list[str]) -> list[MoleculeInput]:
    return [MoleculeInput(i, s, f"m{i}") for i, s in enumerate(smiles)]


def test_select_heavy_atom_filter_keeps_unparsable():
    inputs = _inputs(["CCO", "CCCCCCCCC", "CCCCCCCCCC", "not-a-smiles", "CCCCCCCCCCCC", "C1CCCCC1CCCC"])
    chosen = select(inputs, heavy_atoms=(9, 10))
    assert [m.molecule_id for m in chosen] == [1, 2, 3, 5]
    assert chosen == [inputs[i] for i in (1, 2, 3, 5)]  # entries unchanged, ids preserved
    assert [m.molecule_id for m in select(inputs, heavy_atoms=(3, 3))] == [0, 3]


def test_select_shards_partition_the_input():
    inputs = builtin_sample()
    shards = [select(inputs, shard=(i, 3)) for i in range(3)]
    ids = [{m.molecule_id for m in s} for s in shards]
    assert all(ids[a].isdisjoint(ids[b]) for a in range(3) for b in range(a + 1, 3))
    assert sorted(m.molecule_id for s in shards for m in s) == list(range(len(inputs)))
    assert sorted((m for s in shards for m in s), key=lambda m: m.molecule_id) == inputs
    for i, shard in enumerate(shards):
        assert all(m.molecule_id % 3 == i for m in shard)
        assert [m.molecule_id for m in shard] == sorted(m.molecule_id for m in shard)  # input order
    assert select(inputs, shard=(0, 1)) == inputs


def test_select_shards_stay_a_partition_under_the_filter():
    inputs = builtin_sample()
    filtered = select(inputs, heavy_atoms=(10, 11))
    shards = [select(inputs, heavy_atoms=(10, 11), shard=(i, 3)) for i in range(3)]
    assert sorted((m for s in shards for m in s), key=lambda m: m.molecule_id) == filtered
    assert 25 <= len(filtered) < len(inputs)


def test_select_limit_takes_the_first_of_the_filtered_shard():
    inputs = _inputs(["C" * k for k in range(1, 21)])  # molecule k has k + 1 heavy atoms
    chosen = select(inputs, heavy_atoms=(5, 20), shard=(1, 2), limit=3)
    assert [m.molecule_id for m in chosen] == [5, 7, 9]
    assert [m.molecule_id for m in select(inputs, limit=2)] == [0, 1]
    assert len(select(inputs, limit=100)) == 20
    assert select(inputs, limit=0) == []


@pytest.mark.parametrize("kwargs", [{"shard": (3, 3)}, {"shard": (0, 0)}, {"shard": (-1, 2)},
                                    {"limit": -1}, {"heavy_atoms": (11, 9)}])  # fmt: skip
def test_select_rejects_bad_arguments(kwargs):
    with pytest.raises(InputError):
        select(_inputs(["CCO"]), **kwargs)


def test_parse_range():
    assert parse_range("9-11") == (9, 11)
    assert parse_range("9") == (9, 9)
    assert parse_range(" 9 - 11 ") == (9, 11)
    for bad in ["", "a", "9-", "-9", "11-9", "9-11-12", "9..11", "9.5"]:
        with pytest.raises(InputError, match="e.g. 9-11"):
            parse_range(bad)


def test_parse_shard():
    assert parse_shard("2/8") == (2, 8)
    assert parse_shard("0/1") == (0, 1)
    for bad in ["", "2", "8/8", "9/8", "0/0", "-1/8", "a/b", "2/8/1"]:
        with pytest.raises(InputError, match="e.g. 0/8"):
            parse_shard(bad)


# --- seeds and conformers ----------------------------------------------------------------------


def test_conformer_seed_is_nonzero_deterministic_and_distinct():
    seeds = [conformer_seed(0, i) for i in range(1000)]
    assert all(1 <= s <= 2**31 - 1 for s in seeds)
    assert len(set(seeds)) == 1000
    assert seeds == [conformer_seed(0, i) for i in range(1000)]
    other = [conformer_seed(1, i) for i in range(1000)]
    assert sum(a != b for a, b in zip(seeds, other)) >= 999  # the run seed matters
    assert conformer_seed(7, 2**31 - 2) >= 1
    with pytest.raises(ValueError):
        conformer_seed(0, -1)


def test_conformer_seed_golden_values():
    """Fixed forever: changing the mix changes every conformer of every dataset (and hash() would
    differ between processes)."""
    assert [conformer_seed(0, i) for i in range(3)] == [306888783, 2012355816, 515274002]
    assert conformer_seed(42, 123456) == 174697229


def test_embedding_is_deterministic():
    first = embed_conformers("CC(=O)Nc1ccc(O)cc1", 4, seed=3, molecule_id=17)
    second = embed_conformers("CC(=O)Nc1ccc(O)cc1", 4, seed=3, molecule_id=17)
    assert len(first) == len(second) == 4
    for a, b in zip(first, second):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.atomic_numbers, b.atomic_numbers)
    assert [m.name for m in first] == ["17:0", "17:1", "17:2", "17:3"]


def _rms_angstrom(a, b) -> float:
    return float(np.sqrt(np.mean(np.sum((a.positions - b.positions) ** 2, axis=1)))) / BOHR_PER_ANGSTROM


def test_conformers_differ():
    confs = embed_conformers("CCCCCO", 4, seed=0, molecule_id=0)
    assert len(confs) == 4
    for i in range(len(confs)):
        for j in range(i + 1, len(confs)):
            assert _rms_angstrom(confs[i], confs[j]) > 0.01
    # Another molecule id (or run seed) gives other conformers of the same SMILES.
    assert _rms_angstrom(confs[0], embed_conformers("CCCCCO", 1, seed=0, molecule_id=1)[0]) > 0.01
    assert _rms_angstrom(confs[0], embed_conformers("CCCCCO", 1, seed=1, molecule_id=0)[0]) > 0.01


def test_conformer_atoms_and_bohr_units():
    (mol,) = embed_conformers("CCO", 1, seed=0, molecule_id=5)
    assert mol.natom == 9 and mol.formula == "CCOHHHHHH" and mol.charge == 0 and mol.name == "5:0"
    carbons = np.flatnonzero(mol.atomic_numbers == 6)
    hydrogens = np.flatnonzero(mol.atomic_numbers == 1)
    dist = np.linalg.norm(mol.positions[hydrogens, None] - mol.positions[None, carbons], axis=-1)
    ch_bonds = dist.min(axis=1)[dist.min(axis=1) < 1.5 * BOHR_PER_ANGSTROM]
    assert len(ch_bonds) == 5
    np.testing.assert_allclose(ch_bonds, 1.09 * BOHR_PER_ANGSTROM, atol=0.04 * BOHR_PER_ANGSTROM)


def test_mmff_relaxation():
    raw = embed_conformers("CCCCO", 2, seed=0, molecule_id=0)
    relaxed = embed_conformers("CCCCO", 2, seed=0, molecule_id=0, relax="mmff")
    assert len(relaxed) == 2
    assert all(_rms_angstrom(r, u) > 0.01 for r, u in zip(raw, relaxed))
    for r in relaxed:  # MMFF's C-O bond is 1.42-1.43 Angstrom
        d = np.linalg.norm(r.positions[3] - r.positions[4]) / BOHR_PER_ANGSTROM
        assert 1.40 < d < 1.45


@pytest.mark.parametrize(
    ("smiles", "reason"),
    [("C1CC", "bad SMILES"), ("", "bad SMILES"), ("[NH4+]", "charged species (charge +1)"),
     ("CC(=O)[O-]", "charged species (charge -1)")],
)  # fmt: skip
def test_conformer_failures(smiles, reason):
    with pytest.raises(ConformerError) as err:
        embed_conformers(smiles, 2, seed=0, molecule_id=0)
    assert err.value.reason == reason


def test_odd_electron_count_is_a_conformer_error():
    with pytest.raises(ConformerError) as err:
        embed_conformers("[CH3]", 1, seed=0, molecule_id=0)
    assert "9 electrons" in err.value.reason and "even electron count" in err.value.reason


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown relax"):
        embed_conformers("CCO", 1, seed=0, molecule_id=0, relax="uff")
    with pytest.raises(ValueError, match="at least 1"):
        embed_conformers("CCO", 0, seed=0, molecule_id=0)
