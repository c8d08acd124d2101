"""What the benchmark scripts share (they run as ``python benchmarks/NAME.py``, so this folder is on the path)."""

from __future__ import annotations

import statistics


def median_range(values: list[float], spec: str = ".3f", width: int = 7) -> str:
    """'median [min-max]' of repeated measurements, each formatted with ``spec``; the median padded to ``width``."""
    return f"{statistics.median(values):{width}{spec}} [{min(values):{spec}}-{max(values):{spec}}]"
