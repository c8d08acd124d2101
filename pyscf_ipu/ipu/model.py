"""A model of the Graphcore IPU: the published facts the planner and the profile reason with.

One IPU (Graphcore, "IPU Programmer's Guide" and product briefs):

- 1472 tiles; each has its own core, 6 hardware worker threads (barrel-scheduled: the tile issues
  one instruction per cycle, each thread every 6th) and its own SRAM, 624 KiB, about 900 MB per
  chip. There is no shared memory: a tile reads only its own SRAM.
- Programs run in bulk-synchronous steps: every tile computes, all synchronise, data is exchanged.
- Bow IPU: 1.85 GHz, ~11 TB/s exchange, ~65 TB/s on-chip memory bandwidth. Mk2 GC200: 1.33 GHz,
  ~8 TB/s exchange, ~47.5 TB/s memory bandwidth. IPUs talk over IPU-Links, 320 GB/s per chip.

The cost constants below are *assumptions* of this simulation, not measurements; the profile
prints them beside every estimate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class IPUModel:
    """One or more identical IPUs. ``tiles`` is per IPU; ``num_ipus`` is how many the planner may use."""

    name: str = "bow"
    tiles: int = 1472
    threads_per_tile: int = 6
    tile_memory_bytes: int = 624 * KIB
    clock_hz: float = 1.85e9
    exchange_bytes_per_s: float = 11e12  # on-chip, all tiles together
    memory_bytes_per_s: float = 65e12  # on-chip SRAM, all tiles together
    ipu_link_bytes_per_s: float = 320e9  # between IPUs
    num_ipus: int = 1
    available_memory_proportion: float = 0.6  # share of each tile's SRAM the contraction may use
    # -- cost assumptions (cycles per tile, all 6 threads together) --
    rows_cycles_per_element: float = 0.5  # dense block x vector: 2 float32 MACs per cycle (64-bit loads)
    s8_cycles_per_integral: float = 24.0  # unpack 4 indices, 6 gathers, 6 MACs, 6 accumulates
    eri_ops_per_cycle: float = 4.0  # float32 operations of the device ERI kernels (ipu.eri_tiles)
    sync_cycles: int = 150  # one BSP synchronisation across the chip
    link_sync_seconds: float = 5e-6  # one synchronisation across IPU-Links

    def __post_init__(self) -> None:
        for field in ("tiles", "threads_per_tile", "tile_memory_bytes", "num_ipus"):
            if getattr(self, field) < 1:
                raise ValueError(f"IPU model: {field} must be at least 1, got {getattr(self, field)}")
        if not 0 < self.available_memory_proportion <= 1:
            raise ValueError(
                f"IPU model: available memory proportion must be in (0, 1], got {self.available_memory_proportion}"
            )

    @property
    def budget_bytes(self) -> int:
        """Bytes of one tile that the contraction may use."""
        return int(self.tile_memory_bytes * self.available_memory_proportion)

    def replace(self, **changes) -> IPUModel:
        return dataclasses.replace(self, **changes)

    def assumptions(self) -> dict[str, float | int | str]:
        """Every number of the model, for the profile report."""
        return dataclasses.asdict(self)


PRESETS: dict[str, IPUModel] = {
    "bow": IPUModel(),
    "mk2": IPUModel(
        name="mk2",
        clock_hz=1.33e9,
        exchange_bytes_per_s=8e12,
        memory_bytes_per_s=47.5e12,
    ),
}


def ipu_model(
    preset: str = "bow",
    *,
    num_ipus: int = 1,
    tiles: int | None = None,
    available_memory_proportion: float = 0.6,
) -> IPUModel:
    """A preset (``bow`` or ``mk2``) with the given number of IPUs, tile override and memory share."""
    try:
        model = PRESETS[preset.lower()]
    except KeyError:
        raise ValueError(f"unknown IPU model {preset!r}: choose one of {', '.join(PRESETS)}") from None
    changes = {"num_ipus": num_ipus, "available_memory_proportion": available_memory_proportion}
    if tiles is not None:
        changes["tiles"] = tiles
    return model.replace(**changes)
