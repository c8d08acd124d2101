"""The ``ipu`` J-K backend: plan the tiles, lay out the integrals, contract tile by tile."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from .contract import contract, layout, place, rows_layout_batch
from .model import IPUModel
from ..padding import bucket, stack_members
from .plan import TilePlan, Workload, plan, plan_on


@dataclass(frozen=True)
class IPUJK:
    """J and K on a simulated IPU; ``strategy`` is ``auto``, ``rows`` or ``s8``.

    Frozen and hashable: it is part of the SCF loop's static settings, so one compiled loop serves
    every molecule whose padded shapes and plan layout agree.
    """

    model: IPUModel = field(default_factory=IPUModel)
    strategy: str = "auto"
    name: str = "ipu"

    def plans(self, eri_s8: np.ndarray, nao: int, nao_padded: int, dtype,
              kept: int | None = None) -> tuple[TilePlan, TilePlan]:  # fmt: skip
        """(shape plan, real plan): the padded problem's plan, which picks the strategy, the IPUs and
        the array shapes shared by a shape bucket (and raises TileMemoryError if nothing fits), and
        the molecule's own plan on the same strategy and IPUs, which places the work and is profiled.
        ``kept`` is ``eri_s8``'s non-zero count where the caller knows it (counted here otherwise).
        """
        value_bytes = np.dtype(dtype).itemsize
        kept = int(np.count_nonzero(eri_s8)) if kept is None else kept
        shape = plan(Workload(nao_padded, bucket(kept, minimum=1024), value_bytes), self.model, self.strategy)
        real = plan_on(Workload(nao, kept, value_bytes), self.model, shape.strategy.name, shape.num_ipus)
        return shape, real

    def prepare(self, eri_s8, nao, nao_padded, dtype, kept=None):
        shape, real = self.plans(eri_s8, nao, nao_padded, dtype, kept)
        return place(layout(shape, real, eri_s8, nao, dtype), shape.num_ipus)

    def prepare_batch(self, eris, nao, nao_padded, dtype, kept=None):
        """The conformers' layouts stacked. Where they share one ``rows`` layout on one device (the
        usual case: conformers have the same AO count and nearly the same integral count), the row
        matrices of the whole batch are gathered by one vmapped program, straight into the stack:
        laid out one by one and then stacked, each conformer's 20 MB of rows (9 heavy atoms,
        STO-3G) was written twice."""
        kept = [None] * len(eris) if kept is None else kept
        shapes = [self.plans(eri, nao, nao_padded, dtype, count)[0] for eri, count in zip(eris, kept)]
        sharded = shapes[0].num_ipus > 1 and len(jax.devices()) >= shapes[0].num_ipus  # placed IPU by IPU
        batched = None if sharded else rows_layout_batch(shapes, eris, nao, dtype)
        if batched is None:
            return stack_members([self.prepare(eri, nao, nao_padded, dtype, count) for eri, count in zip(eris, kept)])
        return batched

    def contract(self, data, dm):
        return contract(data, dm)

    def profile(self, eri_s8, nao, nao_padded, dtype, iterations: int, kept=None) -> dict:
        from .profile import profile_report

        return profile_report(self.plans(eri_s8, nao, nao_padded, dtype, kept)[1], iterations)
