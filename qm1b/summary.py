"""A generator run's summary: what it wrote, how fast, and where the time went; one per shard or Ray
task, summed for a Ray run (:meth:`Summary.add`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Host stages that a run pays once, not per conformer: compiling or loading its programs, and the
# size buckets' templates.
ONCE_PER_RUN = ("programs", "templates")
OPTIMIZER_WORKERS = "optimizer (workers)"  # the host stage of geomeTRIC's steps in their worker processes


@dataclass
class Summary:
    out: str
    shard: str
    molecules: int = 0
    conformers: int = 0  # written
    converged: int = 0
    labelled: int = 0  # converged or not: written, or dropped as failures (NaN, --drop-unconverged)
    failures: int = 0
    skipped: int = 0  # already done (resume)
    seconds: float = 0.0
    timings: Counter[str] = field(default_factory=Counter)  # seconds per stage, summed
    host: Counter[str] = field(default_factory=Counter)  # the host's CPU seconds per stage (HostClock)
    tasks: int = 0  # Ray tasks summed up here (0: one shard in one process)
    # the batches whose wall time holds no program loading or compiling (neither the batch nor the
    # one dispatched beside it is its size bucket's first): their conformers and seconds
    steady_conformers: int = 0
    steady_seconds: float = 0.0
    method: str = ""  # the basis, J-K backend and batch sizes the run used (:func:`chosen`)
    optimizer_steps: int = 0  # --relax dft: the relaxations' gradient evaluations, summed
    # per compiled program: [signatures loaded or compiled, their wall seconds, other calls, their wall
    # seconds] (:func:`pyscf_ipu.programs.program_times`; on an accelerator a call's seconds are its dispatch)
    programs: dict[str, list] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.tasks} Ray tasks" if self.tasks else f"shard {self.shard}"

    @property
    def conformers_per_hour(self) -> float:
        return 3600.0 * self.conformers / self.seconds if self.seconds else 0.0

    @property
    def steady_conformers_per_hour(self) -> float | None:
        """The rate over the batches that load or compile no programs (what a long run approaches);
        None where every batch did."""
        return 3600.0 * self.steady_conformers / self.steady_seconds if self.steady_seconds else None

    def add(self, other: Summary) -> None:
        """Add a shard's or Ray task's counts and times to these (the steady rate so summed is a task's,
        not the cluster's)."""
        for name in ("molecules", "conformers", "converged", "labelled", "failures", "skipped", "steady_conformers",
                     "steady_seconds", "optimizer_steps"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.timings.update(other.timings)
        self.host.update(other.host)
        for name, times in other.programs.items():
            self.programs[name] = [a + b for a, b in zip(self.programs.get(name, [0, 0.0, 0, 0.0]), times)]

    def to_dict(self) -> dict:
        """The summary as JSON-able data; ``host_ms_per_conformer`` is the host's CPU time per labelled
        conformer without what a run pays once (:data:`ONCE_PER_RUN`), ``once_seconds`` those."""
        labelled = self.conformers + self.failures
        steady = sum(v for k, v in self.host.items() if k not in ONCE_PER_RUN)
        return {**{k: getattr(self, k) for k in ("out", "shard", "method", "molecules", "conformers", "converged",
                                                   "failures", "skipped", "seconds", "tasks", "optimizer_steps")},
                "conformers_per_hour": self.conformers_per_hour,
                "steady_conformers_per_hour": self.steady_conformers_per_hour, "timings": dict(self.timings),
                "host": dict(self.host), "host_ms_per_conformer": 1000 * steady / labelled if labelled else None,
                "programs": {name: dict(zip(("loads", "load_seconds", "calls", "call_seconds"), times))
                             for name, times in self.programs.items()},
                "once_seconds": {k: self.host[k] for k in ONCE_PER_RUN if k in self.host}}  # fmt: skip

    def lines(self) -> list[str]:
        rate = self.converged / self.conformers if self.conformers else 0.0
        split = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.timings.items(), key=lambda kv: -kv[1]))
        lines = [
            f"{self.out} ({self.where}; {self.method}): {self.conformers} conformers of {self.molecules} molecules "
            f"written, {rate:.1%} converged; {self.failures} failures; {self.skipped} already done",
            f"{self.seconds:.1f}s, {self.conformers_per_hour:,.0f} conformers per hour"
            + (f" ({self.steady_conformers_per_hour:,.0f} in batches that load no programs)" if self.steady_seconds
               else "")
            + f"; time: {split}",
        ]
        labelled = self.conformers + self.failures
        if self.optimizer_steps:
            relaxed = self.conformers + self.failures
            lines.append(f"relaxed: {self.optimizer_steps / relaxed:.1f} optimiser steps per conformer, "
                         f"{self.timings['relaxation'] / relaxed:.2f}s each; host CPU per step "
                         f"{1000 * self.host['relaxation'] / self.optimizer_steps:.1f} ms in this process, "
                         f"{1000 * self.host[OPTIMIZER_WORKERS] / self.optimizer_steps:.1f} ms in geomeTRIC's "
                         "workers")  # fmt: skip
        if labelled and self.host:
            per = {k: 1000 * v / labelled for k, v in self.host.items()}
            steady = sum(v for k, v in per.items() if k not in ONCE_PER_RUN)
            lines.append(f"host CPU per conformer: {steady:.1f} ms, and "
                         + ", ".join(f"{k} {per[k]:.1f} ms" for k in ONCE_PER_RUN if k in per)
                         + " (" + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])
                                            if k not in ONCE_PER_RUN) + ")")  # fmt: skip
        if self.programs:
            by_cost = sorted(self.programs.items(), key=lambda kv: -(kv[1][1] + kv[1][3]))
            loading = sum(times[1] for times in self.programs.values())
            lines.append(f"programs: {loading:.1f}s loading or compiling, then calls (on a CPU their run time): "
                         + ", ".join(f"{name} {times[1]:.1f}s + {times[2]} x {times[3] / max(times[2], 1):.3f}s"
                                     for name, times in by_cost if times[1] + times[3] >= 0.05))  # fmt: skip
        return lines
