"""A simulated Graphcore IPU: a chip model, a tile planner, a BSP executor in JAX and a profile."""

from .backend import IPUJK
from .model import PRESETS, IPUModel, ipu_model
from .plan import STRATEGY_NAMES, TileMemoryError, TilePlan, Workload, plan, plan_on

__all__ = [
    "IPUJK",
    "IPUModel",
    "PRESETS",
    "STRATEGY_NAMES",
    "TileMemoryError",
    "TilePlan",
    "Workload",
    "ipu_model",
    "plan",
    "plan_on",
]
