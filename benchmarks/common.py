"""What the benchmark scripts share (they run as ``python benchmarks/NAME.py``, so this folder is on the path)."""

from __future__ import annotations

import re
import statistics

# the generator's summary line: its own seconds (the interpreter's start and imports excluded)
SUMMARY = re.compile(r"^([0-9.]+)s, [0-9,]+ conformers per hour", re.M)


def print_label_differences(columns: dict, reference: list[dict], labels) -> None:
    """Ours minus PySCF in meV, per label: ``columns`` a dataset's columns (eV), ``reference`` PySCF's
    labels (eV) of the same conformers ordered by (molecule id, conformer id)."""
    import numpy as np

    order = np.lexsort((columns["conformer_id"], columns["molecule_id"]))
    count = len(reference)
    print(f"\nlabels, ours - PySCF (meV) over {count} conformers; converged: ours {int(columns['converged'].sum())}"
          f"/{count} (QM1B criterion), PySCF {sum(r['converged'] for r in reference)}/{count}:")  # fmt: skip
    for q in labels:
        diff = 1000 * (columns[q][order] - np.array([r[q] for r in reference]))
        print(f"  {q:6s} max |d| {np.max(np.abs(diff)):7.3f}   mean d {np.mean(diff):+7.3f}")


def median_range(values: list[float], spec: str = ".3f", width: int = 7) -> str:
    """'median [min-max]' of repeated measurements, each formatted with ``spec``; the median padded to ``width``."""
    return f"{statistics.median(values):{width}{spec}} [{min(values):{spec}}-{max(values):{spec}}]"
