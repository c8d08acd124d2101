"""QM9 against itself: held-out QM9 molecules labelled at QM9's own level (``--preset qm9``:
B3LYP/6-31G(2df,p)) from QM9's own geometries, beside PySCF's float64 labels at the same settings, and
both against the HOMO, LUMO and gap QM9 published (Gaussian 09).

Our labels come from the generator as a user runs it (``qm1b generate --preset qm9 --geometries``, on
a CSV of the chosen rows in qm9pack's layout); PySCF's from :func:`pyscf_ipu.reference.pyscf_reference`
with the settings the dataset recorded (the same grid and fitting basis). The molecules are drawn at
random (``--seed``) from QM9's indices from ``--first-index`` on, which no test uses, leaving out those
of the generator's built-in sample (the tests embed its SMILES). Prints the
distribution of each difference, and writes them as JSON and a figure where asked::

    python benchmarks/qm9_published.py --molecules 50 --json qm9.json --plot qm9.png

Why the two programs differ from QM9's values is in ``docs/decisions/qm9-published-labels.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pyscf_ipu.molecule import Molecule  # noqa: E402
from pyscf_ipu.qm9 import row_heavy_atoms, rows  # noqa: E402
from pyscf_ipu.reference import pyscf_reference  # noqa: E402
from pyscf_ipu.resolution import resolve  # noqa: E402
from pyscf_ipu.units import HARTREE_TO_EV  # noqa: E402
from qm1b.settings import dft_config  # noqa: E402
from qm1b.store import open_dataset  # noqa: E402

HELD_OUT_FROM = 100_001  # the tests' QM9 molecules all have smaller indices (tests/test_qm9_published.py)
BUILTIN_SAMPLE = ROOT / "qm1b" / "data" / "gdb_sample.smi"  # its QM9 molecules are named qm9_<index>
LABELS = {"homo": "HOMO", "lumo": "LUMO", "gap": "gap"}


def sample_indices() -> set[int]:
    """The QM9 indices of the generator's built-in sample, whose SMILES the tests use."""
    return {int(n) for n in re.findall(r"\bqm9_(\d+)", BUILTIN_SAMPLE.read_text())}


def held_out(count: int, first_index: int, max_heavy_atoms: int, seed: int) -> list[dict]:
    """``count`` qm9pack rows drawn at random (``seed``) from those of index ``first_index`` or more and
    at most ``max_heavy_atoms`` heavy atoms, none of the built-in sample's, in index order."""

    pool = [row for row in rows() if int(row["Index"]) >= first_index and row_heavy_atoms(row) <= max_heavy_atoms]
    used = sample_indices()
    if len(pool) < count:
        raise SystemExit(f"only {len(pool)} QM9 molecules from index {first_index} with at most {max_heavy_atoms} "
                         f"heavy atoms; ask for fewer")  # fmt: skip
    # drawn with room for the sample's, which are then dropped: the draw's order does not depend on them
    drawn = random.Random(seed).sample(pool, min(len(pool), count + len(used)))
    chosen = [row for row in drawn if int(row["Index"]) not in used][:count]
    if len(chosen) < count:
        raise SystemExit(f"only {len(chosen)} QM9 molecules outside the built-in sample; ask for fewer")
    return sorted(chosen, key=lambda row: int(row["Index"]))


def label_ours(chosen: list[dict], work: Path, options: list[str]) -> tuple[dict, list[dict], float]:
    """The generator's labels (eV) of ``chosen``, one conformer each, by molecule in input order, with
    the dataset's recorded settings and the run's wall seconds."""
    source = work / "held_out.csv"
    with source.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(chosen[0]))
        writer.writeheader()
        writer.writerows(chosen)
    out = work / "labels"
    command = [sys.executable, "-m", "qm1b.cli", "generate", "--preset", "qm9", "--geometries", str(source),
               "--out", str(out), "--no-progress", *options]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"qm1b generate failed ({done.returncode}): {last}")
    seconds = time.perf_counter() - started
    with open_dataset(out) as dataset:
        settings = dict(dataset.attrs["settings"])
        records = sorted(dataset.records(), key=lambda rec: int(rec["molecule_id"]))
    if len(records) != len(chosen):
        raise SystemExit(f"the generator labelled {len(records)} of {len(chosen)} molecules; see {out}")
    return settings, records, seconds


def compare(chosen: list[dict], records: list[dict], settings: dict) -> list[dict]:
    """Per molecule: QM9's, our and PySCF's HOMO, LUMO and gap (eV), and whether each converged."""
    method = resolve(dft_config(settings))
    table = []
    for row, rec in zip(chosen, records):
        molecule = Molecule(np.asarray(rec["z"], int), np.asarray(rec["pos"], float))
        started = time.perf_counter()
        ref = pyscf_reference(molecule, method)
        homo, lumo = float(row["HOMO_au"]), float(row["LUMO_au"])
        table.append({
            "index": int(row["Index"]), "smiles": row["SMILES"], "atoms": len(molecule.atomic_numbers),
            "qm9": {"homo": homo * HARTREE_TO_EV, "lumo": lumo * HARTREE_TO_EV, "gap": (lumo - homo) * HARTREE_TO_EV},
            "ours": {"homo": float(rec["homo"]), "lumo": float(rec["lumo"]), "gap": float(rec["y"])},
            "pyscf": {"homo": ref.homo * HARTREE_TO_EV, "lumo": ref.lumo * HARTREE_TO_EV,
                      "gap": ref.gap * HARTREE_TO_EV},
            "converged": {"ours": bool(rec["converged"]), "pyscf": bool(ref.converged)},
            "pyscf_seconds": time.perf_counter() - started,
        })  # fmt: skip
        gaps = {side: table[-1][side]["gap"] for side in ("qm9", "ours", "pyscf")}
        print(f"  QM9 {row['Index']:>6s} {row['SMILES']:24s} gap: QM9 {gaps['qm9']:7.4f}  ours {gaps['ours']:7.4f}  "
              f"PySCF {gaps['pyscf']:7.4f} eV", flush=True)  # fmt: skip
    return table


def differences(table: list[dict]) -> dict:
    """meV, per label: ours - PySCF, ours - QM9 and PySCF - QM9, each as its values and their summary."""
    out = {}
    for pair, (a, b) in {"ours_minus_pyscf": ("ours", "pyscf"), "ours_minus_qm9": ("ours", "qm9"),
                         "pyscf_minus_qm9": ("pyscf", "qm9")}.items():  # fmt: skip
        out[pair] = {}
        for label in LABELS:
            d = 1000.0 * np.array([row[a][label] - row[b][label] for row in table])
            out[pair][label] = {"values": d.round(4).tolist(), "mean": float(d.mean()), "std": float(d.std()),
                                "median": float(np.median(d)), "max_abs": float(np.abs(d).max())}  # fmt: skip
    return out


def report(diffs: dict, count: int) -> None:
    print(f"\nover {count} held-out QM9 molecules, meV:   mean      std   median  max |d|")
    for pair, by_label in diffs.items():
        for label, s in by_label.items():
            print(f"  {pair:18s} {LABELS[label]:5s} {s['mean']:+9.3f} {s['std']:8.3f} {s['median']:+8.3f} "
                  f"{s['max_abs']:8.3f}")  # fmt: skip


def plot(diffs: dict, path: str) -> None:
    """One panel per label: the distributions of ours - QM9 and PySCF - QM9 (they overlap where ours
    equals PySCF's), with ours - PySCF's range in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LABELS), figsize=(4 * len(LABELS), 3.4), constrained_layout=True)
    for ax, label in zip(axes, LABELS):
        ours, theirs = diffs["ours_minus_qm9"][label]["values"], diffs["pyscf_minus_qm9"][label]["values"]
        bins = np.histogram_bin_edges(ours + theirs, bins=15)
        ax.hist(theirs, bins=bins, alpha=0.5, label="PySCF float64 - QM9")
        ax.hist(ours, bins=bins, histtype="step", linewidth=2, label="ours (float32) - QM9")
        ax.set_xlabel(f"{LABELS[label]} difference from QM9 (meV)")
        ax.set_title(f"{LABELS[label]}: |ours - PySCF| <= {diffs['ours_minus_pyscf'][label]['max_abs']:.3f} meV",
                     fontsize=9)  # fmt: skip
    axes[0].set_ylabel("molecules")
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=50)
    parser.add_argument("--first-index", type=int, default=HELD_OUT_FROM, help="draw from QM9's indices from this on")
    parser.add_argument("--max-heavy-atoms", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", metavar="FILE", help="write the table and the differences here")
    parser.add_argument("--plot", default="", metavar="FILE.png", help="draw the distributions here")
    parser.add_argument("--work", default="", help="keep the generator's input and dataset here (a new folder)")
    parser.add_argument("generate_options", nargs="*", help="more options for qm1b generate, after --")
    args = parser.parse_args()
    if args.molecules < 1:
        raise SystemExit("--molecules must be at least 1")

    try:
        chosen = held_out(args.molecules, args.first_index, args.max_heavy_atoms, args.seed)
    except ModuleNotFoundError as err:  # qm9pack
        raise SystemExit(str(err)) from None
    print(f"{len(chosen)} QM9 molecules (indices {chosen[0]['Index']} to {chosen[-1]['Index']}), "
          f"qm1b generate --preset qm9 {' '.join(args.generate_options)}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        settings, records, seconds = label_ours(chosen, work, args.generate_options)
    print(f"ours: {seconds:.1f} s in a fresh process ({settings['xc']}/{settings['basis']}, grid level "
          f"{settings['grid_level']}, J-K {settings['jk']}, integrals {settings['integrals']}); "
          "PySCF float64:")  # fmt: skip
    table = compare(chosen, records, settings)
    diffs = differences(table)
    report(diffs, len(table))
    converged = {side: sum(row["converged"][side] for row in table) for side in ("ours", "pyscf")}
    print(f"converged: ours {converged['ours']}/{len(table)}, PySCF {converged['pyscf']}/{len(table)}")
    if args.json:
        out = {"settings": settings, "our_seconds": seconds, "converged": converged, "molecules": table,
               "differences_mev": diffs}
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(diffs, args.plot)


if __name__ == "__main__":
    main()
