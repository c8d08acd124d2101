"""The public entry points: restricted Kohn-Sham, molecules -> :class:`SCFResult`.

    preparation (integrals and grid, :mod:`pyscf_ipu.prepare`) -> padded, batched SCFProblem
    -> compiled SCF loop -> float64 finalisation (purification and grid pass queued on the device,
    the Fock matrix and eigensolve on the host)

:func:`submit_batch` runs conformers of molecules of one size bucket as one batched loop; it
returns at once (JAX dispatches asynchronously), so the caller can prepare the next batch on the
host while the device works, then collect with :meth:`BatchRun.results`. :func:`run_rks` is a batch
of one.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from .config import RKSConfig
from .integral_sources import integral_source
from .molecule import Molecule
from .prepare import HostProblem, prepare
from .problem import batch_members, build_batch, padded_sizes
from .results import FinalDensity, SCFResult, dispatch_finalisation, finalise
from .scf import LoopSettings, SCFTrace, scf_program


def run_rks(
    molecule: Molecule,
    config: RKSConfig = RKSConfig(),
    *,
    host: HostProblem | None = None,
    sizes: tuple[int, int] | None = None,
    profile: bool = False,
) -> SCFResult:
    """Restricted Kohn-Sham for ``molecule`` under ``config``: :func:`submit_batch` of one conformer.

    ``host`` reuses an earlier preparation of ``molecule`` (same settings); ``sizes`` forces the
    padded (AOs, grid points) shape; ``profile`` adds the simulated IPU's report (``jk_profile``).
    The result's ``seconds`` include the preparation.
    """
    start = time.perf_counter()
    hosts = [host] if host is not None else prepare([molecule], config)
    (result,) = submit_batch(hosts, config, sizes=sizes, profile=profile).results()
    return dataclasses.replace(result, seconds=time.perf_counter() - start)


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
    profile: bool = False

    def results(self) -> list[SCFResult]:
        t = time.perf_counter()
        trace, final = jax.device_get(jax.block_until_ready((self.trace, self.final)))
        wait = time.perf_counter() - t
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
            report = self._profile(host, result.iterations) if self.profile else None
            out.append(dataclasses.replace(result, timings=timings, jk_profile=report))
        seconds = (time.perf_counter() - self.start) / len(out)
        return [dataclasses.replace(r, seconds=seconds) for r in out]

    def _profile(self, host: HostProblem, iterations: int) -> dict | None:
        """The J-K backend's report of how it spread one conformer's work, with the device ERIs' own
        tile plan on the same IPUs where the integrals came from the device."""
        backend = self.settings.backend
        report = backend.profile(host.eri, self.shapes[0], np.dtype(self.config.precision), iterations)
        plan = None if report is None else integral_source(self.config.integrals).eri_plan(
            self.config.basis, tuple(host.mol.elements))  # fmt: skip
        if plan is None:
            return report
        from .ipu.eri_tiles import plan_eri_tiles

        return {**report, "eri_tiles": plan_eri_tiles(plan, backend.model).report()}


def submit_batch(
    hosts: list[HostProblem],
    config: RKSConfig = RKSConfig(),
    *,
    sizes: tuple[int, int] | None = None,
    batch_size: int | None = None,
    profile: bool = False,
) -> BatchRun:
    """Start one batched SCF loop over ``hosts`` (conformers of molecules of one size bucket).

    ``sizes`` defaults to the bucket's padded shape; ``batch_size`` pads a short batch so that it
    reuses the compiled loop of a full one; ``profile`` asks the results for the J-K backend's report.
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
        trace = scf_program(problems, settings)  # returns before the device is done where dispatch is asynchronous
        final = dispatch_finalisation(config, settings, members, problems, sizes, trace)  # queued behind it
        dispatch = time.perf_counter() - t
    timings = {"to_device": to_device, "dispatch": dispatch}
    return BatchRun(list(hosts), config, settings, sizes, trace, final, timings, start, profile)
