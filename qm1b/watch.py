"""The convergence watch: a run whose conformers mostly fail to converge stops, with what to check."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .settings import CONVERGENCE_WINDOW

if TYPE_CHECKING:
    from .settings import Run


class NotConvergingError(RuntimeError):
    """Most of a run's recent conformers did not converge; the message says what to check."""


@dataclass
class ConvergenceWatch:
    """Stops a run whose conformers mostly fail to converge.

    A sound setup converges nearly every conformer; a run where most of the last ``window`` (or more:
    whole batches) did not points at its setup (float32 products below full precision, a bad basis,
    too few ``--max-iterations``), and labelling on would fill the dataset with unconverged rows.
    The occasional hard conformer never trips it. A whole run, however short, is judged when it ends
    (:meth:`finish`, by :func:`generate` over every shard or Ray task). ``minimum`` 0 switches it off.
    """

    minimum: float
    window: int
    hint: str  # the settings worth checking, for the message
    batches: deque = field(default_factory=deque)  # (conformers labelled, converged) of recent batches

    def add(self, labelled: int, converged: int) -> None:
        """Count a finished batch; :class:`NotConvergingError` if the recent share is below ``minimum``."""
        self.batches.append((labelled, converged))
        while sum(n for n, _ in self.batches) - self.batches[0][0] >= self.window:
            self.batches.popleft()  # the window stays full without its oldest batch
        total, good = (sum(column) for column in zip(*self.batches))
        if total >= self.window and good < self.minimum * total:
            raise self._error(good, f"the last {total}")

    def finish(self, labelled: int, converged: int) -> None:
        """At a run's end, its totals: :class:`NotConvergingError` if its converged share is below
        ``minimum``, however few conformers it labelled."""
        if labelled and converged < self.minimum * labelled:
            raise self._error(converged, f"the {labelled}")

    def _error(self, good: int, which: str) -> NotConvergingError:
        return NotConvergingError(
            f"only {good} of {which} conformers converged (below --min-converged {self.minimum:g}): that points "
            f"at the setup, not the molecules; check {self.hint}; what was committed is kept "
            "(--min-converged 0 labels on regardless)")  # fmt: skip


def convergence_watch(run: Run, batch: int, device: str) -> ConvergenceWatch:
    """The run's :class:`ConvergenceWatch`, for batches of up to ``batch`` conformers on ``device``."""
    dft = run.dft
    return ConvergenceWatch(run.gen.min_converged, max(CONVERGENCE_WINDOW, batch),
                            f"--max-iterations ({dft.max_iterations}), --basis ({dft.basis}), --precision "
                            f"({dft.precision}) and the device ({device})")  # fmt: skip
