"""The public entry points: restricted Kohn-Sham single points, molecule -> :class:`SCFResult`.

    host preparation (PySCF, float64) -> padded SCFProblem (float32 or float64)
    -> jitted SCF loop -> float64 finalisation (purification and grid pass queued on the device,
    J/K and eigensolve on the host)

:func:`run_rks` runs one molecule. :func:`submit_batch` runs conformers of one molecule (equal
shapes) as one vmapped loop; it returns at once (JAX dispatches asynchronously), so the caller can
prepare the next batch on the host while the device works, then collect with ``.results()``.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from .config import RKSConfig, precision_scope
from .host import HostProblem, integral_source, prepare, prepare_conformers
from .molecule import Molecule
from .problem import batch_members, build_batch, build_problem, final_inputs, padded_sizes
from .results import FinalDensity, SCFResult, final_density, finalise
from .scf import LoopSettings, SCFTrace, scf_loop, scf_loop_batch


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
    overlap, weights = final_inputs(host, sizes)
    source = integral_source(config.integrals)
    jk = source.final_jk(settings.backend, problem.jk)  # J and K on the device, or ()
    final = final_density(settings.functional, problem.ao, weights, trace.density, overlap, *jk)
    result = finalise(host, trace, final, config, problem.shapes)
    timings["finalise"] = time.perf_counter() - t
    profile = settings.backend.profile(host.eri_s8, host.nao, problem.shapes[0], dtype, result.iterations,
                                       host.eri_kept)  # fmt: skip
    plan = None if profile is None else source.eri_plan(config.basis, tuple(host.mol.elements))
    if plan is not None:  # the device ERIs' own tile plan on the same IPUs
        from .ipu.eri_tiles import plan_eri_tiles

        profile = {**profile, "eri_tiles": plan_eri_tiles(plan, settings.backend.model).report()}
    return dataclasses.replace(result, timings=timings, seconds=time.perf_counter() - start, jk_profile=profile)


@dataclasses.dataclass
class BatchRun:
    """A batch in flight on the device; :meth:`results` waits for it and finalises on the host."""

    hosts: list[HostProblem]
    config: RKSConfig
    settings: LoopSettings
    shapes: tuple[int, int]
    trace: SCFTrace  # stacked, possibly still computing
    final: FinalDensity  # stacked, queued behind the loop
    timings: dict[str, float]
    start: float

    def results(self) -> list[SCFResult]:
        t = time.perf_counter()
        trace, final = jax.device_get(jax.block_until_ready((self.trace, self.final)))
        wait = time.perf_counter() - t
        dtype = np.dtype(self.config.precision)
        out = []
        for i, host in enumerate(self.hosts):
            t = time.perf_counter()
            member = jax.tree.map(lambda a: a[i], (trace, final))
            result = finalise(host, *member, self.config, self.shapes)
            timings = {
                **host.timings,
                **{k: v / len(self.hosts) for k, v in self.timings.items()},
                "scf_wait": wait / len(self.hosts),
                "finalise": time.perf_counter() - t,
            }
            profile = self.settings.backend.profile(host.eri_s8, host.nao, self.shapes[0], dtype, result.iterations,
                                                    host.eri_kept)  # fmt: skip
            out.append(dataclasses.replace(result, timings=timings, jk_profile=profile))
        seconds = (time.perf_counter() - self.start) / len(out)
        return [dataclasses.replace(r, seconds=seconds) for r in out]


def submit_batch(
    hosts: list[HostProblem],
    config: RKSConfig = RKSConfig(),
    *,
    sizes: tuple[int, int] | None = None,
    batch_size: int | None = None,
) -> BatchRun:
    """Start one vmapped SCF loop over ``hosts`` (conformers: same atoms, so the same AO count).

    ``sizes`` defaults to the largest padded shape of the batch; ``batch_size`` pads a short batch
    so that it reuses the compiled loop of a full one.
    """
    start = time.perf_counter()
    settings = LoopSettings.from_config(config)
    sizes = sizes or padded_sizes(hosts[0])  # the batch's one size bucket (build_batch checks)
    dtype = np.dtype(config.precision)
    with precision_scope(config.precision):
        t = time.perf_counter()
        members = batch_members(hosts, batch_size)
        problems = build_batch(members, settings.backend, dtype, sizes)
        to_device = time.perf_counter() - t
        t = time.perf_counter()
        trace = scf_loop_batch(problems, settings)  # asynchronous: returns before the device is done
        final = batch_finalisation(config, settings, members, problems, sizes, trace)  # queued behind it
        dispatch = time.perf_counter() - t
    return BatchRun(list(hosts), config, settings, sizes, trace, final, {"to_device": to_device, "dispatch": dispatch}, start)


def batch_finalisation(config: RKSConfig, settings: LoopSettings, members: list[HostProblem], problems,
                       sizes: tuple[int, int], trace: SCFTrace) -> FinalDensity:  # fmt: skip
    """Dispatch the float64 finalisation of a batch's loop ``trace`` (asynchronous; see
    :func:`~pyscf_ipu.results.final_density`): ``members`` and ``problems`` as the loop had them."""
    overlap, weights = (np.stack(a) for a in zip(*(final_inputs(h, sizes) for h in members)))
    jk = integral_source(config.integrals).final_jk(settings.backend, problems.jk)  # J and K on the device, or ()
    return final_density(settings.functional, problems.ao, weights, trace.density, overlap, *jk)


def run_rks_batch(molecules: list[Molecule], config: RKSConfig = RKSConfig(), **kwargs) -> list[SCFResult]:
    """Conformers of one molecule as one batch: host preparation, one vmapped loop, finalisation."""
    needs_grid = bool(LoopSettings.from_config(config).functional.pieces)
    hosts = prepare_conformers(molecules, config, needs_grid=needs_grid)
    return submit_batch(hosts, config, **kwargs).results()
