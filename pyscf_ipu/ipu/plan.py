r"""The tile planner: which tile holds which integrals, whether it fits, and what it should cost.

Two strategies, built from the same blocks (a contiguous balanced split of work items over IPUs
and then tiles; per-item and resident bytes; input broadcast and output exchange volumes):

``rows``
    The symmetry-reduced J and K matrices (:func:`pyscf_ipu.packed.row_matrix`) stacked as one
    (2 npair, npair) matrix ``[MJ diag(w); MK]``: each tile owns a contiguous block of its rows and
    the replicated density pairs D_p (npair values). Its compute step is one small dense
    matrix-vector product; the exchange gathers the row results (J pairs, then K pairs).
``s8``
    The unique screened integrals (value + four int16 AO indices, 12 bytes in float32), a
    balanced share per tile, with the density replicated (N^2) and a private J/K accumulator
    (2 N^2) on every tile. The compute step is gather-multiply-scatter; the exchange is a
    reduction of the accumulators over tiles (and over IPUs).

A plan that does not fit one IPU is spread over up to ``model.num_ipus``; ``auto`` takes, of the
strategies that fit, the one with the smallest modelled time per SCF iteration.

The modelled time (seconds) of one J-K build, on the slowest tile (bulk-synchronous):

.. math::

    t_{JK} = \frac{\max_t(\text{items}_t) \cdot c_{item} + 2\,c_{sync}}{f}
           + \frac{B_{out}}{BW_{exchange}} + \frac{B_{link}}{BW_{link}} + [n_{ipu} > 1]\, t_{link\,sync}

with c_item the model's cycles per row element (rows) or per integral (s8), f the clock, B_out the
bytes the output exchange moves on chip and B_link those that cross IPU-Links. One SCF iteration
adds the broadcast of the new density to every used tile and one more sync:
:math:`t_{iter} = t_{JK} + (B_{in} / BW_{exchange}) + c_{sync}/f`. The XC quadrature, DIIS and
the eigensolver are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .model import IPUModel

INDEX_BYTES = 2  # int16 AO indices
STRATEGY_NAMES = ("rows", "s8")


class TileMemoryError(Exception):
    """No plan fits the tiles' memory; the message gives the numbers and what to try."""


@dataclass(frozen=True)
class Workload:
    """What the planner needs to know of one molecule's ERI: sizes only, never the integrals."""

    nao: int
    unique_integrals: int  # non-zero unique (8-fold symmetric) integrals after screening
    value_bytes: int = 4  # float32

    @property
    def npair(self) -> int:
        return self.nao * (self.nao + 1) // 2

    @property
    def unique_total(self) -> int:
        """Unique integrals before screening: npair (npair + 1) / 2, as a Python int (no overflow)."""
        return self.npair * (self.npair + 1) // 2

    @property
    def sparsity(self) -> float:
        """Share of the unique integrals that screening removed."""
        return 1.0 - self.unique_integrals / self.unique_total if self.unique_total else 0.0


def split_even(total: int, parts: int) -> np.ndarray:
    """Contiguous balanced split: chunks of ceil(total/parts) items, the last one the remainder.

    Uses as few chunks as that chunk size allows, so the maximum per chunk (what a BSP step waits
    for) is minimal and only the last chunk is ragged. Returns the counts (int64) of the used chunks.
    """
    if total <= 0:
        return np.zeros(0, np.int64)
    per = -(-total // parts)
    used = -(-total // per)
    counts = np.full(used, per, np.int64)
    counts[-1] = total - per * (used - 1)
    return counts


@dataclass(frozen=True)
class Strategy:
    """A way to spread the contraction, described by its sizes; the executor lays it out."""

    name: str
    item: str  # what one work item is

    def total_items(self, w: Workload) -> int:
        return 2 * w.npair if self.name == "rows" else w.unique_integrals

    def bytes_per_item(self, w: Workload) -> int:
        if self.name == "rows":
            return w.npair * w.value_bytes + w.value_bytes  # the matrix row and its result
        return w.value_bytes + 4 * INDEX_BYTES

    def resident_bytes(self, w: Workload) -> dict[str, int]:
        """Buffers every used tile holds whatever its share: replicated input, private accumulators."""
        if self.name == "rows":
            return {"replicated_density": w.npair * w.value_bytes}
        n2 = w.nao * w.nao
        return {"replicated_density": n2 * w.value_bytes, "accumulators": 2 * n2 * w.value_bytes}

    def cycles_per_item(self, w: Workload, model: IPUModel) -> float:
        if self.name == "rows":
            return w.npair * model.rows_cycles_per_element
        return model.s8_cycles_per_integral

    def output_bytes(self, w: Workload, tiles_used: int) -> int:
        """On-chip exchange after the compute step: row results gathered, or accumulators reduced."""
        if self.name == "rows":
            return 2 * w.npair * w.value_bytes
        return tiles_used * 2 * w.nao * w.nao * w.value_bytes

    def link_bytes(self, w: Workload, num_ipus: int) -> int:
        """Bytes over IPU-Links: each IPU's result to the others (gather) or a ring all-reduce."""
        if num_ipus == 1:
            return 0
        if self.name == "rows":
            return (num_ipus - 1) * 2 * w.npair * w.value_bytes
        return 2 * (num_ipus - 1) * 2 * w.nao * w.nao * w.value_bytes


STRATEGIES = {name: Strategy(name, "row" if name == "rows" else "integral") for name in STRATEGY_NAMES}


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Who holds what: per-tile work and bytes for ``num_ipus`` IPUs x ``model.tiles`` tiles."""

    strategy: Strategy
    model: IPUModel
    workload: Workload
    num_ipus: int
    items: np.ndarray  # (num_ipus, tiles) int64: work items per tile, 0 on idle tiles
    memory: dict[str, np.ndarray] = field(repr=False)  # category -> (num_ipus, tiles) bytes

    @property
    def tile_bytes(self) -> np.ndarray:
        """(num_ipus, tiles) bytes each tile needs."""
        return sum(self.memory.values())

    @property
    def used(self) -> np.ndarray:
        return self.items > 0

    @property
    def tiles_used(self) -> int:
        return int(np.count_nonzero(self.used))

    @property
    def total_bytes(self) -> int:
        return int(self.tile_bytes.sum())

    @property
    def fits(self) -> bool:
        return int(self.tile_bytes.max()) <= self.model.budget_bytes

    @property
    def max_items(self) -> int:
        return int(self.items.max())

    @property
    def imbalance(self) -> float:
        """Load imbalance: max / mean work over used tiles (1.0 is perfect)."""
        return float(self.items.max() / self.items[self.used].mean()) if self.tiles_used else 1.0

    # -- the time model (see the module docstring) --
    @property
    def compute_cycles(self) -> float:
        return self.max_items * self.strategy.cycles_per_item(self.workload, self.model)

    @property
    def input_bytes(self) -> int:
        """The density broadcast to every used tile at the start of an iteration."""
        return self.tiles_used * self.strategy.resident_bytes(self.workload)["replicated_density"]

    @property
    def output_bytes(self) -> int:
        return self.strategy.output_bytes(self.workload, self.tiles_used)

    @property
    def link_bytes(self) -> int:
        return self.strategy.link_bytes(self.workload, self.num_ipus)

    @property
    def exchange_bytes_per_iteration(self) -> int:
        return self.input_bytes + self.output_bytes + self.link_bytes

    @property
    def jk_seconds(self) -> float:
        m = self.model
        seconds = (self.compute_cycles + 2 * m.sync_cycles) / m.clock_hz
        seconds += self.output_bytes / m.exchange_bytes_per_s + self.link_bytes / m.ipu_link_bytes_per_s
        return seconds + (m.link_sync_seconds if self.num_ipus > 1 else 0.0)

    @property
    def iteration_seconds(self) -> float:
        m = self.model
        return self.jk_seconds + self.input_bytes / m.exchange_bytes_per_s + m.sync_cycles / m.clock_hz


def layout_items(total: int, num_ipus: int, tiles: int) -> np.ndarray:
    """(num_ipus, tiles) item counts: a balanced split over IPUs, then over each IPU's tiles."""
    items = np.zeros((num_ipus, tiles), np.int64)
    for ipu, share in enumerate(split_even(total, num_ipus)):
        counts = split_even(int(share), tiles)
        items[ipu, : len(counts)] = counts
    return items


def plan_on(workload: Workload, model: IPUModel, strategy: str, num_ipus: int) -> TilePlan:
    """The plan of ``strategy`` on exactly ``num_ipus`` IPUs (fitting or not: see ``TilePlan.fits``)."""
    s = STRATEGIES[strategy]
    items = layout_items(s.total_items(workload), num_ipus, model.tiles)
    used = items > 0
    memory = {f"{s.item}s": items * s.bytes_per_item(workload)}
    for name, size in s.resident_bytes(workload).items():
        memory[name] = np.where(used, np.int64(size), 0)
    return TilePlan(s, model, workload, num_ipus, items, memory)


def plan_strategy(workload: Workload, model: IPUModel, strategy: str) -> TilePlan:
    """The plan of ``strategy`` on the fewest IPUs (up to ``model.num_ipus``) where it fits."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown tile strategy {strategy!r}: choose auto, {', '.join(STRATEGY_NAMES)}")
    for k in range(1, model.num_ipus + 1):
        candidate = plan_on(workload, model, strategy, k)
        if candidate.fits:
            return candidate
    raise TileMemoryError(_no_fit_message(workload, model, [candidate]))


def plan(workload: Workload, model: IPUModel, strategy: str = "auto") -> TilePlan:
    """A fitting tile plan; ``auto`` picks the strategy with the least modelled time per iteration."""
    if strategy != "auto":
        return plan_strategy(workload, model, strategy)
    fitting, failed = [], []
    for name in STRATEGY_NAMES:
        try:
            fitting.append(plan_strategy(workload, model, name))
        except TileMemoryError:
            failed.append(plan_on(workload, model, name, model.num_ipus))
    if not fitting:
        raise TileMemoryError(_no_fit_message(workload, model, failed))
    return min(fitting, key=lambda p: (p.iteration_seconds, p.num_ipus))


def _no_fit_message(workload: Workload, model: IPUModel, attempts: list[TilePlan]) -> str:
    budget = model.budget_bytes
    parts = [
        f"'{p.strategy.name}' needs {int(p.tile_bytes.max()):,} bytes on its fullest tile "
        f"({p.total_bytes:,} in all) on {p.num_ipus} IPU(s)"
        for p in attempts
    ]
    others = [s for s in STRATEGY_NAMES if s not in {p.strategy.name for p in attempts}]
    hint = "; or --jk-strategy " + "/".join(others) if others else ""
    return (
        f"the ERI contraction for {workload.nao} AOs ({workload.unique_integrals:,} unique integrals) does not fit: "
        + "; ".join(parts)
        + f"; but a tile may use only {budget:,} bytes ({model.available_memory_proportion:.0%} of "
        f"{model.tile_memory_bytes:,}; {model.tiles} tiles per IPU, at most {model.num_ipus} IPU(s)). "
        "Try more IPUs (--ipus), "
        f"Schwarz screening (--eri-threshold){hint}, or density fitting (--jk df), which holds no N^4 array"
    )
