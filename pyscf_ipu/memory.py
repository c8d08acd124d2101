"""The memory a batch needs at its peak, estimated from its size bucket before anything is computed.

A run that does not fit would otherwise be killed by the kernel minutes in (the ERIs grow as N^4),
so both command lines estimate the peak first and refuse a batch above the memory budget, with the
numbers. The estimate adds, per conformer, what the integral source holds on the host (ERIs, AO
values) and what the J-K backend builds from them (its arrays and their build's temporaries), times
the batch, plus the loaded process. The per-part counts and how they were checked against measured
peaks are in ``docs/decisions/memory-budget.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


from .buckets import SizeBucket
from .grid import FORCES_GRID_BLOCK
from .method import Method
from .packed import s8_size

GB = 1e9
PROCESS_BYTES = int(0.5 * GB)  # JAX, XLA and PySCF loaded, with a small molecule's arrays
DEFAULT_SHARE = 0.8  # of the machine's memory, the default budget: room for the system and the page cache
DEVICE_SHARE = 0.6  # of an accelerator's memory, what a batch may take (the rest: XLA's own and fragmentation)
MOST_CONFORMERS = 1024  # a batch's most conformers, however many fit


class MemoryBudgetError(ValueError):
    """A batch would need more memory than the budget; the message gives the numbers and what to change."""


@dataclass(frozen=True)
class MemoryEstimate:
    """The bytes a batch holds at its peak, by part (each part summed over the batch)."""

    parts: tuple[tuple[str, int], ...]  # (what, bytes)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def describe(self) -> str:
        """E.g. ``ERIs 1.8 GB + J-K arrays 5.3 GB + AO values 0.1 GB + process 0.5 GB``."""
        return " + ".join(f"{what} {n / GB:.1f} GB" for what, n in self.parts if n)


def forces_bytes(bucket: SizeBucket, method: Method, conformers: int) -> int:
    """What a batch's gradient programs (:mod:`pyscf_ipu.device_forces`) hold beside its arrays: the
    exchange-correlation part's block of :data:`~pyscf_ipu.grid.FORCES_GRID_BLOCK` points, its AO values
    and their first and second derivatives with their cotangents (20 (B, Np) float64 arrays per
    conformer, all conformers at once), and the larger of the two-electron part's one conformer at a
    time: its s8 ERIs' weights and destinations, or its fitted 3-centre integrals, their solve and
    their weights (3 (Qp, npair) float64 arrays)."""
    nao = bucket.nao_padded
    xc = 20 * 8 * FORCES_GRID_BLOCK * nao if method.needs_grid else 0
    fitted = 3 * 8 * bucket.naux_padded * (nao * (nao + 1) // 2)
    two_electron = fitted if bucket.occupied else 2 * 8 * s8_size(nao)
    return conformers * xc + two_electron


def batch_memory(bucket: SizeBucket, method: Method, conformers: int, prepared_ahead: int = 0,
                 forces: bool = False) -> MemoryEstimate:  # fmt: skip
    """The peak of a batch of ``conformers`` of ``bucket``'s molecules under ``method``.

    ``prepared_ahead``: conformers of the next batch prepared while this one runs (the generator
    prepares batch k+1 while batch k runs): their host preparation, their J-K arrays and their AO
    values on the device are held at the same time. ``forces``: the batch's gradients are computed
    too, by the device's programs where the integral source computes them there (:func:`forces_bytes`;
    the host's gradients come a conformer at a time once the batch has run).
    """
    value_bytes = method.dtype.itemsize
    nao = bucket.nao_padded
    grid = bucket.grid_points_padded if method.needs_grid else 0
    held = method.integrals.held_bytes(nao, grid, value_bytes)  # one conformer's
    # the s8 ERIs or the fitted factor, and what is held only while one conformer's are made
    eris, making = method.backend.eri_bytes(bucket, held["eris"], method.integrals.fitting_bytes(bucket), value_bytes)
    jk = method.backend.layout_bytes(bucket, value_bytes)
    device_ao = 4 * grid * nao * value_bytes  # (4, Gp, Np) in the loop's precision
    host = conformers + prepared_ahead
    return MemoryEstimate((
        ("ERIs", host * eris + making),
        ("J-K arrays", conformers * jk + prepared_ahead * method.backend.resident_bytes(bucket, value_bytes)),
        ("AO values", host * (held["ao_values"] + device_ao)),
        ("forces", forces_bytes(bucket, method, conformers) if forces and method.integrals.gradients == "device" else 0),
        ("process", PROCESS_BYTES),
    ))  # fmt: skip


def default_budget() -> float:
    """GB: :data:`DEFAULT_SHARE` of this machine's memory, or of the container's limit where it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # cgroup v2: "max" or a byte count
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return round(DEFAULT_SHARE * total / GB, 1)


def largest_batch(bucket: SizeBucket, method: Method, most: int, budget_gb: float, ahead: bool = True,
                  forces: bool = False) -> int:  # fmt: skip
    """The largest batch of at most ``most`` conformers of ``bucket`` whose peak fits ``budget_gb``,
    with the next batch prepared beside it (as the generator runs) where ``ahead``, and its gradients
    where ``forces``; 0 if not even one does."""
    fits = (size for size in range(most, 0, -1)
            if batch_memory(bucket, method, size, size if ahead else 0, forces).total <= budget_gb * GB)  # fmt: skip
    return next(fits, 0)


def check_memory(bucket: SizeBucket, method: Method, conformers: int, budget_gb: float, what: str,
                 forces: bool = False) -> None:  # fmt: skip
    """Both command lines' memory check: :class:`MemoryBudgetError` if a batch of ``conformers`` of
    ``bucket`` (``what``, e.g. a molecule's name) needs more than ``budget_gb`` even without the next
    batch prepared beside it. The message gives the numbers and the largest batch that fits, or, where
    not even one does, what to change (the J-K backend's advice first). ``forces``: with its gradients."""
    estimate = batch_memory(bucket, method, conformers, forces=forces)
    if estimate.total <= budget_gb * GB:
        return
    fits = largest_batch(bucket, method, conformers - 1, budget_gb, ahead=False, forces=forces)
    advice = (f"--batch-size {fits} fits" if fits else
              f"not even one conformer fits: try {method.backend.memory_advice}a smaller basis or, where the "
              "machine has the memory, a larger --memory-budget")  # fmt: skip
    raise MemoryBudgetError(
        f"{what} ({bucket.nao_padded} AOs, J-K backend {method.config.jk}) needs about {estimate.total / GB:.1f} GB "
        f"({estimate.describe()}), above the memory budget of {budget_gb:g} GB (--memory-budget); {advice}")


def device_batch(bucket: SizeBucket, method: Method, conformers: int, device_bytes: int, forces: bool = False) -> int:
    """The batch size of ``bucket`` on an accelerator of ``device_bytes``: the largest power of two, at
    most ``conformers`` rounded up to one and :data:`MOST_CONFORMERS`, whose arrays, with the next
    batch's beside them (:func:`batch_memory` less the process) and its gradients' where ``forces``,
    fit :data:`DEVICE_SHARE` of it; at least 1."""
    size = 1
    while size < min(conformers, MOST_CONFORMERS):
        size *= 2
    while size > 1 and (batch_memory(bucket, method, size, size, forces).total - PROCESS_BYTES
                        > DEVICE_SHARE * device_bytes):  # fmt: skip
        size //= 2
    return size
