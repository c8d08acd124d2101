#!/usr/bin/env python
"""Regenerate ``qm1b/data/gdb_sample.smi``, the built-in input sample of the QM1B generator.

The sample is ~100 GDB-like neutral closed-shell molecules with 9 to 11 heavy atoms (C, N, O, F):

* 64 molecules with 9 heavy atoms from QM9 (the GDB-17 subset with up to 9 heavy atoms), read
  offline through ``pyscf_ipu.qm9`` (package ``qm9pack``). To get a mix, QM9's 9-heavy-atom
  molecules are split into five groups (hydrocarbons with / without rings, N/O compounds with /
  without rings, fluorine compounds) and each group contributes a fixed number of molecules at
  evenly spaced positions, i.e. spread over QM9's index range (a molecule that ETKDG cannot embed,
  such as a few strained cages, is replaced by the next one). QM9's SMILES are kept verbatim.
* 36 molecules with 10 or 11 heavy atoms written by hand below (drug-fragment-like: paracetamol,
  salicylic acid, quinoline, ...), beyond QM9's size as GDB-11 is.

Molecules that RDKit cannot parse, charged species and zwitterions are skipped, and every line is
checked (RDKit-valid, 9-11 heavy atoms, only C/N/O/F, no formal charges, even electron count, unique
id, not a duplicate) before the file is written. The output is deterministic: run this with the same
qm9pack and RDKit to get the same bytes.

Developers run it; the generator never does:

    python scripts/make_gdb_sample.py           # rewrite qm1b/data/gdb_sample.smi (~45 s: reads QM9)
    python scripts/make_gdb_sample.py --check   # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rdkit import Chem, rdBase

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "qm1b" / "data" / "gdb_sample.smi"
if str(ROOT) not in sys.path:  # run from a checkout without installing: pyscf_ipu and qm1b live in ROOT
    sys.path.insert(0, str(ROOT))
ALLOWED_ELEMENTS = {"C", "N", "O", "F"}
EMBED_CHECK_CONFORMERS = 4

# How many 9-heavy-atom QM9 molecules each group contributes (64 in all); see group(). Molecules
# with F form one group whatever else they contain, since QM9 has few of them (~1.5%).
QM9_QUOTAS: dict[str, int] = {
    "hydrocarbon, ring": 8,
    "hydrocarbon, chain": 4,
    "N/O, ring": 32,
    "N/O, chain": 12,
    "fluorinated": 8,
}

# 10 and 11 heavy atoms, written by hand: (SMILES, id). Common drugs, metabolites and building blocks.
HAND_WRITTEN: list[tuple[str, str]] = [
    # 10 heavy atoms
    ("c1ccc2ccccc2c1", "naphthalene"),
    ("c1ccc2ncccc2c1", "quinoline"),
    ("Cc1c[nH]c2ccccc12", "skatole"),
    ("Fc1ccc2[nH]ccc2c1", "5-fluoroindole"),
    ("Cc1nc2ccccc2[nH]1", "2-methylbenzimidazole"),
    ("O=C1Cc2ccccc2N1", "oxindole"),
    ("c1ccc2c(c1)CCNC2", "tetrahydroisoquinoline"),
    ("OC(=O)Cc1ccccc1", "phenylacetic-acid"),
    ("COC(=O)c1ccccc1", "methyl-benzoate"),
    ("CC(=O)Nc1ccccc1", "acetanilide"),
    ("OC(=O)c1ccccc1O", "salicylic-acid"),
    ("Nc1ccccc1C(=O)O", "anthranilic-acid"),
    ("NC(=O)Nc1ccccc1", "phenylurea"),
    ("NCCc1ccc(O)cc1", "tyramine"),
    ("OCCOc1ccccc1", "2-phenoxyethanol"),
    ("NC(=O)c1ccc(F)cc1", "4-fluorobenzamide"),
    ("FC(F)(F)c1ccccc1", "benzotrifluoride"),
    ("NNC(=O)c1ccncc1", "isoniazid"),
    ("CNC(=O)c1cccnc1", "N-methylnicotinamide"),
    ("COC(=O)c1cccnc1", "methyl-nicotinate"),
    ("Cn1ccc(=O)n(C)c1=O", "1,3-dimethyluracil"),
    ("NCC(=O)NC(C)C(=O)O", "glycylalanine"),
    ("CCC1(C)CC(=O)NC1=O", "ethosuximide"),
    ("CCCC(CCC)C(=O)O", "valproic-acid"),
    ("CC(=O)N1CCN(C)CC1", "1-acetyl-4-methylpiperazine"),
    # 11 heavy atoms
    ("CC(=O)Nc1ccc(O)cc1", "paracetamol"),
    ("COC(=O)c1ccc(O)cc1", "methylparaben"),
    ("COc1cc(C=O)ccc1O", "vanillin"),
    ("O=c1ccc2ccccc2o1", "coumarin"),
    ("O=C1Nc2ccccc2C1=O", "isatin"),
    ("Oc1cccc(C(F)(F)F)c1", "3-trifluoromethylphenol"),
    ("OC(=O)Cc1ccc(F)cc1", "4-fluorophenylacetic-acid"),
    ("CC(C)CC(CN)CC(=O)O", "pregabalin"),
    ("NC12CC3CC(CC(C3)C1)C2", "amantadine"),
    ("c1cc(C2CCCN2)cnc1", "nornicotine"),
    ("CCOC(=O)C1CCNCC1", "ethyl-isonipecotate"),
]


def describe_problem(smiles: str, heavy_range: tuple[int, int] = (9, 11)) -> str | None:
    """Why ``smiles`` does not belong in the sample, or None if it does."""
    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return "RDKit cannot parse it"
    if not heavy_range[0] <= mol.GetNumHeavyAtoms() <= heavy_range[1]:
        return f"{mol.GetNumHeavyAtoms()} heavy atoms"
    elements = {a.GetSymbol() for a in mol.GetAtoms()}
    if not elements <= ALLOWED_ELEMENTS:
        return f"elements {sorted(elements - ALLOWED_ELEMENTS)}"
    if any(a.GetFormalCharge() for a in mol.GetAtoms()):
        return "formal charges (charged species or zwitterion)"
    if any(a.GetNumRadicalElectrons() for a in mol.GetAtoms()):
        return "radical"
    mol = Chem.AddHs(mol)
    if sum(a.GetAtomicNum() for a in mol.GetAtoms()) % 2:
        return "odd electron count"
    return None


def group(smiles: str) -> str:
    mol = Chem.MolFromSmiles(smiles)
    elements = {a.GetSymbol() for a in mol.GetAtoms()}
    if "F" in elements:
        return "fluorinated"
    kind = "N/O" if elements & {"N", "O"} else "hydrocarbon"
    return f"{kind}, {'ring' if mol.GetRingInfo().NumRings() else 'chain'}"


def embeddable(smiles: str) -> bool:
    """Whether the generator's own ETKDG settings give conformers (some strained QM9 cages fail)."""
    from qm1b.conformers import ConformerError, embed_conformers

    try:
        return len(embed_conformers(smiles, EMBED_CHECK_CONFORMERS, seed=0, molecule_id=0)) > 0
    except ConformerError:
        return False


def spread_pick(items: list, count: int, accept: Callable) -> list:
    """``count`` accepted items spread evenly over ``items``.

    Target k is the middle of the k-th of ``count`` equal slices; from there the first accepted item
    not yet taken is chosen (so a rejected molecule is replaced by its next neighbour in index order).
    """
    chosen: list = []
    taken: set[int] = set()
    for k in range(count):
        start = (2 * k + 1) * len(items) // (2 * count)
        index = next((j for j in range(start, len(items)) if j not in taken and accept(items[j])), None)
        if index is None:
            raise SystemExit(f"not enough acceptable molecules after position {start} of {len(items)}")
        taken.add(index)
        chosen.append(items[index])
    return chosen


def qm9_lines() -> list[tuple[str, str]]:
    from pyscf_ipu.qm9 import iter_qm9

    groups: dict[str, list[tuple[int, str]]] = {name: [] for name in QM9_QUOTAS}
    for record in iter_qm9(heavy_atoms=9):
        if describe_problem(record.smiles, (9, 9)) is None:
            groups[group(record.smiles)].append((record.index, record.smiles))
    chosen = [
        pick
        for name, quota in QM9_QUOTAS.items()
        for pick in spread_pick(groups[name], quota, lambda item: embeddable(item[1]))
    ]
    return [(smiles, f"qm9_{index:06d}") for index, smiles in sorted(chosen)]


def render(lines: list[tuple[str, str]]) -> str:
    header = (
        "# qm1b built-in sample: GDB-like neutral closed-shell molecules, 9-11 heavy atoms (C, N, O, F).\n"
        f"# {sum(i.startswith('qm9_') for _, i in lines)} with 9 heavy atoms from QM9 (id qm9_<QM9 index>, "
        "SMILES verbatim), the rest (10-11 heavy atoms) written by hand.\n"
        "# Generated by scripts/make_gdb_sample.py; do not edit. Format: SMILES id\n"
    )
    return header + "".join(f"{smiles} {name}\n" for smiles, name in lines)


def build() -> str:
    lines = qm9_lines() + HAND_WRITTEN
    problems = [f"{name} {smiles}: {p}" for smiles, name in HAND_WRITTEN if (p := describe_problem(smiles, (10, 11)))]
    problems += [f"{name} {smiles}: {p}" for smiles, name in lines if (p := describe_problem(smiles))]
    ids = [name for _, name in lines]
    problems += [f"duplicate id {name}" for name in sorted({n for n in ids if ids.count(n) > 1})]
    canonical = [Chem.CanonSmiles(smiles) for smiles, _ in lines]
    problems += [f"duplicate molecule {s}" for s in sorted({s for s in canonical if canonical.count(s) > 1})]
    if problems:
        raise SystemExit("invalid sample:\n  " + "\n  ".join(problems))
    return render(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT})")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = build()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run scripts/make_gdb_sample.py", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}: {text.count(chr(10)) - 3} molecules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
