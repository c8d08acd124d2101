"""The ``ipu`` J-K backend: plan the tiles, lay out the integrals, contract tile by tile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from functools import lru_cache

import jax
import numpy as np

from .contract import contract, layout, place, rows_layout, rows_on_host
from .model import IPUModel
from ..padding import padded_size, stack_members
from .plan import TilePlan, Workload, plan, plan_on
from ..jk.exact import ExactERIs
from ..packed import PackedERI, quartet_bytes, s8_size


@dataclass(frozen=True)
class IPUJK(ExactERIs):
    """J and K on a simulated IPU; ``strategy`` is ``auto``, ``rows`` or ``s8``.

    Frozen and hashable: it is part of the SCF loop's static settings, so one compiled loop serves
    every molecule whose padded shapes and plan layout agree.
    """

    model: IPUModel = field(default_factory=IPUModel)
    strategy: str = "auto"
    name: str = "ipu"
    profiles: ClassVar[bool] = True  # its tile plan, on request

    def plans(self, eri: PackedERI, nao_padded: int, dtype) -> tuple[TilePlan, TilePlan]:
        """(shape plan, real plan): the padded problem's plan, which picks the strategy, the IPUs and
        the array shapes shared by a shape bucket (and raises TileMemoryError if nothing fits), and
        the molecule's own plan on the same strategy and IPUs, which places the work and is profiled.
        """
        shape = self.shape_plan(nao_padded, eri.kept, np.dtype(dtype).itemsize)
        return shape, self.real_plan(shape, eri.nao, eri.kept)

    def shape_plan(self, nao_padded: int, kept: int, value_bytes: int) -> TilePlan:
        """The plan of a shape bucket: it depends on sizes only, so it is made once per bucket."""
        return _shape_plan(Workload(nao_padded, padded_size(kept, minimum=1024), value_bytes), self.model, self.strategy)

    def real_plan(self, shape: TilePlan, nao: int, kept: int) -> TilePlan:
        """One molecule's own plan, on the strategy and IPUs of its bucket's ``shape`` plan."""
        workload = Workload(nao, kept, shape.workload.value_bytes)
        return plan_on(workload, self.model, shape.strategy.name, shape.num_ipus)

    def prepare(self, eris, nao_padded, dtype):
        """The layouts of a batch's ERIs ``eris`` (C, s8 size of ``nao_padded``) on the device, planned
        for the bucket's unscreened integral count (so the plan is the bucket's, made once). The
        ``rows`` strategy on one device builds every conformer's row blocks there, in one program; the
        ``s8`` strategy and IPUs placed device by device sort the integrals out on the host."""
        value_bytes = np.dtype(dtype).itemsize
        shape = self.shape_plan(nao_padded, s8_size(nao_padded), value_bytes)
        sharded = shape.num_ipus > 1 and len(jax.devices()) >= shape.num_ipus  # placed IPU by IPU
        if shape.strategy.name == "rows" and not sharded:
            return rows_layout(shape, eris, dtype)
        members = [PackedERI.of(s8) for s8 in np.asarray(eris, dtype)]
        return stack_members([place(layout(shape, self.real_plan(shape, eri.nao, eri.kept), eri, dtype), shape.num_ipus)
                              for eri in members])  # fmt: skip

    def layout_bytes(self, bucket, value_bytes: int) -> int:
        """Peak bytes of :meth:`prepare` for one conformer of ``bucket`` (a
        :class:`~pyscf_ipu.buckets.SizeBucket`; unscreened ERIs), on the strategy its plan picks.
        ``rows`` on the device: the s8 array cast and stacked (npair^2/2 values), its s4 unpacking
        (npair^2), the row matrix (2 npair^2) and the row builder's temporaries (about 3.5 npair^2,
        measured); on a CPU, built on the host: the row matrix, its copy on the device, the s8 array
        cast to ``value_bytes``, the builder's buffers and an empty cache's compiles (5.5 npair^2 in
        all; ``docs/decisions/rows-layout.md``); ``s8``: the unique-quartet records."""
        nao = bucket.nao_padded
        shape = self.shape_plan(nao, s8_size(nao), value_bytes)
        if shape.strategy.name == "rows":
            npair = nao * (nao + 1) // 2
            return int((5.5 if rows_on_host() else 7) * npair * npair * value_bytes)
        return quartet_bytes(nao, value_bytes)

    def resident_bytes(self, bucket, value_bytes: int) -> int:
        """Bytes of :meth:`prepare`'s arrays for one conformer of ``bucket``: the row matrix
        (2 npair^2 values) or the unique-quartet records."""
        nao = bucket.nao_padded
        if self.shape_plan(nao, s8_size(nao), value_bytes).strategy.name == "rows":
            return 2 * (nao * (nao + 1) // 2) ** 2 * value_bytes
        return quartet_bytes(nao, value_bytes)

    def contract(self, data, dm):
        return contract(data, dm)

    def profile(self, eri: PackedERI, nao_padded: int, dtype, iterations: int) -> dict:
        from .profile import profile_report

        return profile_report(self.plans(eri, nao_padded, dtype)[1], iterations)


@lru_cache(maxsize=256)
def _shape_plan(workload: Workload, model: IPUModel, strategy: str) -> TilePlan:
    """:func:`~.plan.plan`, once per (bucketed workload, model, strategy)."""
    return plan(workload, model, strategy)
