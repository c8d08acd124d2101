"""The public entry point: one restricted Kohn-Sham single point, molecule -> :class:`SCFResult`.

    host preparation (PySCF, float64) -> padded SCFProblem (float32 or float64)
    -> jitted SCF loop -> float64 finalisation on the host
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np

from .config import RKSConfig
from .host import HostProblem, prepare
from .molecule import Molecule
from .problem import build_problem, padded_sizes
from .results import SCFResult, finalise
from .scf import LoopSettings, scf_loop


def precision_scope(precision: str):
    """float64 runs need JAX's 64-bit mode; it is switched on for the run only, never globally."""
    return jax.enable_x64(True) if precision == "float64" else contextlib.nullcontext()


def run_rks(
    molecule: Molecule,
    config: RKSConfig = RKSConfig(),
    *,
    host: HostProblem | None = None,
    sizes: tuple[int, int] | None = None,
) -> SCFResult:
    """Restricted Kohn-Sham for ``molecule`` under ``config``.

    ``host`` reuses an earlier host preparation (same molecule and settings); ``sizes`` forces the
    padded (AOs, grid points) shape, so that several molecules share one compiled loop.
    """
    start = time.perf_counter()
    settings = LoopSettings.from_config(config)
    if host is None:
        host = prepare(molecule, config, needs_grid=bool(settings.functional.pieces))
    sizes = sizes or padded_sizes(host)
    timings = dict(host.timings)
    dtype = np.dtype(config.precision)
    with precision_scope(config.precision):
        t = time.perf_counter()
        problem = build_problem(host, settings.backend, dtype, sizes)
        timings["to_device"] = time.perf_counter() - t
        t = time.perf_counter()
        trace = jax.block_until_ready(scf_loop(problem, settings))
        timings["scf_loop"] = time.perf_counter() - t
    t = time.perf_counter()
    result = finalise(host, trace, settings.functional, config, problem.shapes)
    timings["finalise"] = time.perf_counter() - t
    profile = settings.backend.profile(host.eri_s8, host.nao, problem.shapes[0], dtype, result.iterations)
    return dataclasses.replace(result, timings=timings, seconds=time.perf_counter() - start, jk_profile=profile)
