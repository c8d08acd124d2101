r"""The tile plan of the device ERIs: which tile of the simulated IPU evaluates which shell quartets.

The same ideas as the J-K planner (:mod:`.plan`): work items split contiguously and balanced over
tiles, the bytes each tile must hold checked against its budget, more IPUs when one does not fit,
and a modelled time on the slowest tile (bulk-synchronous).

- **Work items** are the shell quartets of :class:`~pyscf_ipu.integrals.eri_plan.EriPlan`, class after
  class. A quartet costs its primitive quartets (K2_bra x K2_ket, padded as the kernel pads them)
  times the modelled operations of one primitive quartet of its class:

  .. math::

      \text{ops}(L, H_b, H_k, Y) = 25 (L + 1) + 3 H_R(L) + 2 H_b H_k (1 + Y),

  the Boys family (about 25 operations per order), the Hermite recursion (3 per R_tuv, H_R of
  them) and the contraction with the bra and ket Hermite matrices (R' gathered, then Y outputs).
  A tile performs the model's ``eri_ops_per_cycle`` of them per cycle (all six threads together).
- **Split:** the quartet sequence is cut where a cumulative weight crosses multiples of total /
  tiles; the weight adds a quartet's share of all the work and its share of all the output bytes,
  so no tile gets more than about twice the mean of either (d classes are cheap per value but
  have many values). The quartets come in the CPU kernels' order, squares of CHUNK bra x CHUNK
  ket pairs (:data:`~pyscf_ipu.integrals.eri_plan.CHUNK`), so a tile's run of them reads few distinct pairs.
- **Memory** of a tile: the Hermite matrices and P - A of every bra and ket pair its quartets read
  (each pair once per tile), plus its output values with their s8 positions (4 + 4 bytes each).
  The one-centre integrals are constants of the plan and are not placed.

The modelled time of one molecule's ERIs is max_t(cycles_t) / f plus one synchronisation; the
outputs stay on their tiles (the ``s8`` J-K strategy reads integrals where they are), so no
exchange is counted. These are the model's numbers, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..integrals.eri_plan import EriPlan
from ..integrals.hermite import hermite_indices
from .model import IPUModel
from .plan import TileMemoryError

VALUE_AND_INDEX_BYTES = 8  # float32 value + int32 s8 position
OUTPUT_BYTES_SHARES = (0.0, 0.25, 1.0)  # weights of the output bytes against the work, tried in turn


@dataclass(frozen=True)
class EriTilePlan:
    """Contiguous runs of shell quartets (in class order) per tile, with their modelled cost and bytes."""

    model: IPUModel
    num_ipus: int
    cuts: np.ndarray  # (tiles_used + 1,) quartet indices: tile t evaluates quartets cuts[t]:cuts[t+1]
    cycles: np.ndarray  # (tiles_used,) modelled compute cycles
    tile_bytes: np.ndarray  # (tiles_used,) bytes held
    quartets: int
    primitive_quartets: int

    @property
    def tiles_used(self) -> int:
        return len(self.cycles)

    @property
    def imbalance(self) -> float:
        """Slowest tile over the mean (1 = perfectly balanced)."""
        return float(self.cycles.max() / self.cycles.mean()) if len(self.cycles) else 1.0

    @property
    def seconds(self) -> float:
        """Modelled time of one molecule's ERIs (the slowest tile, one synchronisation)."""
        return float((self.cycles.max(initial=0.0) + self.model.sync_cycles) / self.model.clock_hz)

    def report(self) -> dict:
        return {
            "ipus_used": self.num_ipus,
            "tiles_used": self.tiles_used,
            "quartets": self.quartets,
            "primitive_quartets": self.primitive_quartets,
            "quartets_per_tile": {"min": int(np.diff(self.cuts).min()), "max": int(np.diff(self.cuts).max())},
            "load_imbalance": self.imbalance,
            "bytes_per_tile": {"min": int(self.tile_bytes.min()), "mean": float(self.tile_bytes.mean()),
                               "max": int(self.tile_bytes.max()), "budget": self.model.budget_bytes},  # fmt: skip
            "estimate": {"cycles_max": float(self.cycles.max()), "seconds_per_molecule": self.seconds,
                         "eri_ops_per_cycle": self.model.eri_ops_per_cycle},  # fmt: skip
        }


def _class_costs(plan: EriPlan) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Per class: the real quartets' (bra rows, ket rows) and each quartet's modelled operations."""
    bras, kets, costs = [], [], []
    for q in plan.quartets:
        bra, ket = plan.pairs[q.bra], plan.pairs[q.ket]
        order_b, order_k = bra.order, ket.order
        hb, hk = len(hermite_indices(order_b)), len(hermite_indices(order_k))
        outputs = ket.functions
        total = order_b + order_k
        ops = 25 * (total + 1) + 3 * len(hermite_indices(total)) + 2 * hb * hk * (1 + outputs)
        primitives = bra.ka * bra.kb * ket.ka * ket.kb
        # the kernels' order: squares of CHUNK bra x CHUNK ket pairs, so a tile's run of them reads few pairs
        bra_rows, ket_rows = q.quartets()
        bras.append(bra_rows)
        kets.append(ket_rows)
        costs.append(np.full(len(bra_rows), float(ops * primitives)))
    return bras, kets, costs


def _pair_bytes(plan: EriPlan, index: int) -> int:
    """Bytes of one pair's data on a tile: its Hermite matrix (K2, S_a S_b, H) and P - A (K2, 3), float32."""
    c = plan.pairs[index]
    k2 = c.ka * c.kb
    return 4 * k2 * (c.functions * len(hermite_indices(c.order)) + 3)


@lru_cache(maxsize=16)
def plan_eri_tiles(plan: EriPlan, model: IPUModel) -> EriTilePlan:
    """Spread ``plan``'s quartets over the fewest IPUs (up to ``model.num_ipus``) whose tiles hold them.

    Cached per (plan, model): a plan is built once per basis and atom order (``host.eri_plan``).
    """
    bras, kets, costs = _class_costs(plan)
    cost = np.concatenate(costs) if costs else np.zeros(0)
    klass = np.concatenate([np.full(len(c), k) for k, c in enumerate(costs)]) if costs else np.zeros(0, int)
    bra_rows, ket_rows = np.concatenate(bras), np.concatenate(kets)
    outputs = np.array([plan.pairs[q.bra].functions * plan.pairs[q.ket].functions for q in plan.quartets])
    pair_bytes = np.array([_pair_bytes(plan, k) for k in range(len(plan.pairs))])
    bra_class = np.array([q.bra for q in plan.quartets])[klass]
    ket_class = np.array([q.ket for q in plan.quartets])[klass]
    out_bytes = VALUE_AND_INDEX_BYTES * outputs[klass].astype(np.float64)
    primitive = int(sum(len(c) * plan.pairs[q.bra].ka * plan.pairs[q.bra].kb * plan.pairs[q.ket].ka
                        * plan.pairs[q.ket].kb for c, q in zip(costs, plan.quartets)))  # fmt: skip
    for num_ipus in range(1, model.num_ipus + 1):
        tiles = min(num_ipus * model.tiles, len(cost))
        # Cut by work alone where the tiles' memory allows (the best balance), else let the output
        # bytes weigh in: high-l classes are cheap per value but have many values, and cut by work
        # alone they crowd a tile's memory (benzene at 6-31G*: beyond 4 IPUs, against 1 so).
        for bytes_share in OUTPUT_BYTES_SHARES:
            cumulative = np.cumsum(cost / max(cost.sum(), 1.0) + bytes_share * out_bytes / max(out_bytes.sum(), 1.0))
            cuts = np.searchsorted(cumulative, cumulative[-1] * np.arange(1, tiles) / tiles, side="right")
            cuts = np.unique(np.concatenate([[0], cuts, [len(cost)]]))
            cycles = np.add.reduceat(cost, cuts[:-1]) / model.eri_ops_per_cycle
            tile_bytes = np.array([
                int(out_bytes[a:b].sum())
                + sum(int(pair_bytes[c]) * len(np.unique(rows[a:b][cls[a:b] == c]))
                      for rows, cls in ((bra_rows, bra_class), (ket_rows, ket_class)) for c in np.unique(cls[a:b]))
                for a, b in zip(cuts[:-1], cuts[1:])
            ])  # fmt: skip
            if tile_bytes.max(initial=0) <= model.budget_bytes:
                return EriTilePlan(model, num_ipus, cuts, cycles, tile_bytes, len(cost), primitive)
    raise TileMemoryError(
        f"the ERIs need {int(tile_bytes.max()):,} bytes on the fullest tile even on {model.num_ipus} IPUs "
        f"({model.budget_bytes:,} allowed per tile): allow more IPUs (--ipus) or a larger --ipu-memory-proportion"
    )
