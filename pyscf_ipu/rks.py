"""The public entry points: restricted Kohn-Sham, molecules -> :class:`SCFResult`.

    RKSConfig -> Method (:func:`pyscf_ipu.method.resolve`, the names as objects)
    -> preparation (integrals and grid, :mod:`pyscf_ipu.prepare`) -> padded, batched SCFProblem
    (:mod:`pyscf_ipu.problem`) -> compiled SCF loop (:mod:`pyscf_ipu.scf`) -> float64 finalisation
    (:mod:`pyscf_ipu.finalisation`: purification and grid pass queued on the device, the Fock
    matrix and eigensolve on the host)

:func:`submit_batch` runs conformers of molecules of one size bucket as one batched loop; it
returns at once (JAX dispatches asynchronously), so the caller can prepare the next batch on the
host while the device works, then collect with :meth:`BatchRun.results`. :func:`run_rks` is a batch
of one.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from .config import RKSConfig
from .finalisation import FinalDensity, dispatch_finalisation, finalise
from .method import Method, resolve
from .molecule import Molecule
from .prepare import PreparedProblem, prepare
from .problem import build_batch, padded_shapes
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

    ``prepared`` reuses an earlier preparation of ``molecule`` (same settings); ``shapes`` forces the
    padded (AOs, grid points) shapes; ``profile`` adds the simulated IPU's report (``jk_profile``).
    The result's ``seconds`` include the preparation.
    """
    start = time.perf_counter()
    method = resolve(config)
    members = [prepared] if prepared is not None else prepare([molecule], method)
    (result,) = submit_batch(members, method, shapes=shapes, profile=profile).results()
    return dataclasses.replace(result, seconds=time.perf_counter() - start)


@dataclasses.dataclass
class BatchRun:
    """A batch in flight on the device; :meth:`results` waits for it and finalises on the host."""

    members: list[PreparedProblem]
    method: Method
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
        for i, prepared in enumerate(self.members):
            t = time.perf_counter()
            member = jax.tree.map(lambda a: a[i], (trace, final))
            result = finalise(prepared, *member, self.method, self.shapes)
            timings = {
                **prepared.timings,
                **{k: v / len(self.members) for k, v in self.timings.items()},
                "scf_wait": wait / len(self.members),
                "finalise": time.perf_counter() - t,
            }
            report = self._profile(prepared, result.iterations) if self.profile else None
            out.append(dataclasses.replace(result, timings=timings, jk_profile=report))
        seconds = (time.perf_counter() - self.start) / len(out)
        return [dataclasses.replace(r, seconds=seconds) for r in out]

    def _profile(self, prepared: PreparedProblem, iterations: int) -> dict | None:
        """The J-K backend's report of how it spread one conformer's work, with the device ERIs' own
        tile plan on the same IPUs where the integrals came from the device."""
        method = self.method
        report = method.backend.profile(prepared.eri, self.shapes[0], method.dtype, iterations)
        plan = None if report is None else method.integrals.eri_plan(method.config.basis, tuple(prepared.mol.elements))
        if plan is None:
            return report
        from .ipu.eri_tiles import plan_eri_tiles

        return {**report, "eri_tiles": plan_eri_tiles(plan, method.backend.model).report()}


def submit_batch(
    members: list[PreparedProblem],
    method: Method,
    *,
    shapes: tuple[int, int] | None = None,
    profile: bool = False,
) -> BatchRun:
    """Start one batched SCF loop over the prepared conformers ``members`` (of molecules of one size
    bucket; a short batch filled up with :func:`~pyscf_ipu.padding.fill_batch` reuses the compiled
    programs of a full one).

    ``shapes`` defaults to the bucket's padded shapes; ``profile`` asks the results for the J-K
    backend's report.
    """
    start = time.perf_counter()
    shapes = shapes or padded_shapes(members[0])  # the batch's one size bucket (build_batch checks)
    with precision_scope(method.config.precision):
        t = time.perf_counter()
        problems = build_batch(members, method.backend, method.dtype, shapes)
        to_device = time.perf_counter() - t
        t = time.perf_counter()
        trace = scf_program(problems, method.loop)  # returns before the device is done where dispatch is asynchronous
        final = dispatch_finalisation(method, members, problems, shapes, trace)  # queued behind it
        dispatch = time.perf_counter() - t
    timings = {"to_device": to_device, "dispatch": dispatch}
    return BatchRun(list(members), method, shapes, trace, final, timings, start, profile)
