"""The public entry points: restricted Kohn-Sham, molecules -> :class:`SCFResult`.

    RKSConfig -> Method (:func:`pyscf_ipu.resolution.resolve`, the names as objects)
    -> the batch's integrals, grid and guess from the integral source (on the host with libcint,
    :mod:`pyscf_ipu.prepare`; on the device with the JAX kernels, :mod:`pyscf_ipu.assembly`)
    -> padded, batched SCFProblem (:mod:`pyscf_ipu.problem`) -> compiled SCF loop
    (:mod:`pyscf_ipu.scf`) -> float64 finalisation (:mod:`pyscf_ipu.finalisation`)

:func:`submit_batch` runs a :class:`~pyscf_ipu.problem.PreparedBatch` (conformers of molecules of one
size bucket) as one batched loop; it returns at once where JAX dispatches asynchronously, so the
caller can prepare the next batch while the device works, then collect with
:meth:`BatchRun.results`. :func:`run_rks` is a batch of one.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from .config import RKSConfig
from .finalisation import FinalDensity, dispatch_finalisation, finalise
from .integral_sources import host_integrals
from .method import Method
from .resolution import resolve
from .molecule import Molecule
from .packed import PackedERI, s8_size
from .prepare import PreparedProblem
from .problem import PreparedBatch, batch_of, prepare_batch
from .programs import precision_scope
from .results import SCFResult
from .scf import SCFTrace, scf_program


def run_rks(
    molecule: Molecule,
    config: RKSConfig = RKSConfig(),
    *,
    prepared: PreparedProblem | None = None,
    shapes: tuple[int, int] | None = None,
    profile: bool = False,
) -> SCFResult:
    """Restricted Kohn-Sham for ``molecule`` under ``config``: :func:`submit_batch` of one conformer.

    ``prepared`` reuses a host preparation of ``molecule`` (:func:`pyscf_ipu.prepare.prepare`, same
    settings) instead of the integral source's; ``shapes`` forces the padded (AOs, grid points)
    shapes (host preparations only); ``profile`` adds the simulated IPU's report (``jk_profile``).
    The result's ``seconds`` include the preparation.
    """
    start = time.perf_counter()
    method = resolve(config)
    if prepared is None:
        batch = prepare_batch([molecule], method, shapes)
    else:
        batch = batch_of(*host_integrals([prepared], method, shapes), prepared.bucket, method)
    (result,) = submit_batch(batch, method, profile=profile).results()
    return dataclasses.replace(result, seconds=time.perf_counter() - start)


@dataclasses.dataclass
class BatchRun:
    """A batch in flight on the device; :meth:`results` waits for it and finalises on the host."""

    batch: PreparedBatch
    method: Method
    trace: SCFTrace  # stacked, possibly still computing
    final: FinalDensity  # stacked, queued behind the loop
    timings: dict[str, float]  # host seconds per conformer, by stage
    start: float
    profile: bool = False

    def results(self) -> list[SCFResult]:
        t = time.perf_counter()
        trace, final = jax.device_get(jax.block_until_ready((self.trace, self.final)))
        members = self.batch.members
        wait = (time.perf_counter() - t) / len(members)
        out = []
        for i, member in enumerate(members):
            t = time.perf_counter()
            result = finalise(member, *jax.tree.map(lambda a: a[i], (trace, final)), self.method, self.batch.shapes)
            timings = {**self.timings, "scf_wait": wait, "finalise": time.perf_counter() - t}
            report = self._profile(member, result.iterations) if self.profile else None
            out.append(dataclasses.replace(result, timings=timings, jk_profile=report))
        seconds = (time.perf_counter() - self.start) / len(out)
        return [dataclasses.replace(r, seconds=seconds) for r in out]

    def _profile(self, member, iterations: int) -> dict | None:
        """The J-K backend's report of how it spread one conformer's work, with the JAX integrals' own
        tile plan on the same IPUs where the integrals came from the device."""
        method = self.method
        npad = self.batch.shapes[0]
        # the JAX integrals screen nothing: every unique integral of the molecule is work
        eri = member.host.eri if member.host is not None else PackedERI(np.zeros(0), member.nao, s8_size(member.nao))
        report = method.backend.profile(eri, npad, method.dtype, iterations)
        plan = None if report is None else method.integrals.eri_plan(method.config.basis, tuple(member.molecule.symbols))
        if plan is None:
            return report
        from .ipu.eri_tiles import plan_eri_tiles

        return {**report, "eri_tiles": plan_eri_tiles(plan, method.backend.model).report()}


def submit_batch(batch: PreparedBatch, method: Method, *, profile: bool = False) -> BatchRun:
    """Start one batched SCF loop over ``batch`` (conformers of molecules of one size bucket; a short
    batch filled up with :func:`~pyscf_ipu.padding.fill_batch` reuses the compiled programs of a full
    one), with its float64 finalisation queued behind it. ``profile`` asks the results for the J-K
    backend's report."""
    start = time.perf_counter()
    with precision_scope(method.config.precision):
        trace = scf_program(batch.problem, method.loop)  # returns before the device is done where dispatch is asynchronous
        final = dispatch_finalisation(method, batch, trace)  # queued behind it
    timings = {**batch.timings, "dispatch": (time.perf_counter() - start) / len(batch.members)}
    return BatchRun(batch, method, trace, final, timings, start, profile)
