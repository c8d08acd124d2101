"""Batched geometry optimisation: many conformers relaxed at once, each by an optimiser of its own.

Each conformer keeps its own geomeTRIC optimiser (Wang and Song, J. Chem. Phys. 144, 214108 (2016)):
translation-rotation internal coordinates (TRIC), a BFGS Hessian from a model guess, a trust radius,
its own convergence test and step count. geomeTRIC normally drives its own loop and asks an engine
for one energy at a time; here the loop is turned inside out. Every round, each unfinished
optimiser proposes a geometry (:meth:`ConformerOptimizer.proposal`), the proposals are computed as
one batched SCF and its batched gradient programs on the device, each starting from its own previous
density, and each optimiser is told its energy and gradient (:meth:`ConformerOptimizer.tell`).

The optimisers run in worker processes (:class:`WorkerOptimizers`), beside the device: the batch is
two halves, and while the device evaluates one half the host reads the other's results and its
workers take their steps. A finished conformer leaves its slot and the next waiting one takes it;
on an accelerator the batch never changes shape, so each program compiles once per size bucket
(:func:`relax`, :func:`keeps_width`).

The gradient includes the grid's response (:mod:`pyscf_ipu.gradients`): at a coarse grid the energy
and a fixed-grid gradient disagree enough to trap an optimiser. The SCF continues in float64 to
converged orbitals (``RKSConfig.for_forces``), so that energy differences are meaningful at
geomeTRIC's 1e-6 Hartree criterion.

Why geomeTRIC and internal coordinates rather than a first-order optimiser in Cartesians:
``docs/decisions/batched-relaxation.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .config import MAX_STEPS, Criteria
from .gradients import gradient_source
from .method import Method
from .molecule import Molecule
from .problem import batch_of
from .programs import compiled, usable_cores
from .results import SCFResult
from .rks import BatchRun, submit_batch
from .units import BOHR_PER_ANGSTROM

COLLIDED_ANGSTROM = 0.5  # two atoms closer than this have collided
BONDED = 1.5  # atoms closer than this times the sum of their covalent radii are bonded (fragments)


@dataclass(frozen=True, eq=False)
class Frame:
    """One evaluated geometry of an optimisation: step 0 is the start."""

    step: int
    molecule: Molecule  # positions in Bohr
    result: SCFResult
    gradient: np.ndarray = field(repr=False)  # (natm, 3) dE/dR, Hartree/Bohr

    @property
    def energy(self) -> float:
        return self.result.energy


@dataclass(frozen=True, eq=False)
class Relaxation:
    """What one conformer's optimisation came to: its frames (the last one the relaxed geometry),
    and why it stopped where it did not converge."""

    frames: tuple[Frame, ...]
    failure: str  # "" where it converged
    seconds: float  # the conformer's share of the batch's wall time, every step included
    optimizer_seconds: float = 0.0  # CPU seconds its geomeTRIC optimiser took, in whichever process

    @property
    def converged(self) -> bool:
        return not self.failure

    @property
    def steps(self) -> int:
        """Gradient evaluations, the start's included (as PySCF's geomeTRIC driver counts them)."""
        return len(self.frames)

    @property
    def final(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


class _Engine:
    """What geomeTRIC's optimiser asks for an energy: the answer the batch computed at the
    geometry it proposed (geomeTRIC's ``Engine`` interface, as far as its optimiser uses it)."""

    def __init__(self, molecule):
        self.M = molecule
        self.answer: tuple[np.ndarray, float, np.ndarray] | None = None

    def calc(self, coords, dirname, read_data=False, copydir=None) -> dict:
        positions, energy, gradient = self.answer
        if not np.array_equal(coords, positions):
            raise RuntimeError("geomeTRIC asked for the energy of a geometry it had not proposed")
        return {"energy": energy, "gradient": gradient.ravel()}

    def clearCalcs(self) -> None:  # geomeTRIC's name
        pass

    def save_guess_files(self, dirname) -> None:
        pass

    def load_guess_files(self, dirname) -> None:
        pass


class ConformerOptimizer:
    """One conformer's geomeTRIC optimiser, driven from outside: :meth:`proposal` gives the next
    geometry to compute (None once finished), :meth:`tell` its energy and gradient."""

    def __init__(self, molecule: Molecule, criteria: Criteria = Criteria(), max_steps: int = MAX_STEPS):
        import geometric.molecule
        from geometric.internal import DelocalizedInternalCoordinates
        from geometric.optimize import Optimizer
        from geometric.params import OptParams

        self.start = molecule
        self.evaluations = 0
        self.failure = ""
        self.finished = False
        self.optimizer = None  # a single atom has nothing to relax: its start is its minimum
        if molecule.natom < 2:
            return
        logging.getLogger("geometric").setLevel(logging.WARNING)  # its per-step report: ours prints one
        described = geometric.molecule.Molecule()
        described.elem = list(molecule.symbols)
        described.xyzs = [molecule.positions / BOHR_PER_ANGSTROM]  # Angstrom
        coordinates = DelocalizedInternalCoordinates(described, build=True, connect=False, addcart=False)  # TRIC
        self.engine = _Engine(described)
        self.optimizer = Optimizer(molecule.positions.ravel().copy(), described, coordinates, self.engine, None,
                                   OptParams(maxiter=max_steps, **criteria.params()), print_info=False)  # fmt: skip

    def proposal(self) -> np.ndarray | None:
        """(natm, 3) Bohr: the geometry whose energy and gradient the optimiser needs next."""
        if self.finished:
            return None
        return self.start.positions if self.optimizer is None else self.optimizer.X.reshape(-1, 3)

    def tell(self, energy: float, gradient: np.ndarray) -> None:
        """The energy (Hartree) and gradient ((natm, 3) Hartree/Bohr) at :meth:`proposal`'s geometry;
        the optimiser judges its last step, then proposes the next or finishes (geomeTRIC's own loop,
        ``Optimizer.optimizeGeometry``, one evaluation at a time)."""
        from geometric.optimize import OPT_STATE

        opt = self.optimizer
        if opt is None:
            self.evaluations, self.finished = 1, True
            return
        self.engine.answer = (opt.X, float(energy), np.asarray(gradient, float))
        opt.calcEnergyForce()
        if self.evaluations == 0:
            opt.prepareFirstStep()
        else:
            opt.evaluateStep()
        self.evaluations += 1
        if opt.state == OPT_STATE.CONVERGED:
            self.finished = True
        elif opt.state == OPT_STATE.FAILED:
            self.stop(f"not converged in {opt.params.maxiter} steps")
        else:
            opt.step()
            while opt.state == OPT_STATE.SKIP_EVALUATION:  # the coordinates were rebuilt: step again
                opt.step()

    def stop(self, reason: str) -> None:
        """End this optimisation unconverged, for ``reason``."""
        self.failure, self.finished = reason, True


def structure_problem(start: Molecule, positions: np.ndarray) -> str:
    """Why ``start``'s atoms at ``positions`` (natm, 3) Bohr cannot be a conformer of it ("" if they
    can): two atoms collided, or the molecule came apart into more fragments than it started in."""
    distance = np.linalg.norm(positions[:, None] - positions[None], axis=-1) / BOHR_PER_ANGSTROM  # (natm, natm)
    np.fill_diagonal(distance, np.inf)
    first, second = np.unravel_index(np.argmin(distance), distance.shape)
    if distance[first, second] < COLLIDED_ANGSTROM:
        return (f"atoms collided: {start.symbols[first]}{first + 1} and {start.symbols[second]}{second + 1} "
                f"{distance[first, second]:.2f} Angstrom apart")  # fmt: skip
    before, after = _fragments(start, start.positions), _fragments(start, positions)
    return f"atoms flew apart: {before} fragment(s) became {after}" if after > before else ""


def _fragments(molecule: Molecule, positions: np.ndarray) -> int:
    """Connected groups of atoms, bonded where closer than :data:`BONDED` times their covalent radii."""
    from pyscf.data.radii import COVALENT
    from scipy.sparse.csgraph import connected_components

    radii = COVALENT[molecule.atomic_numbers]  # Bohr
    bonded = np.linalg.norm(positions[:, None] - positions[None], axis=-1) < BONDED * (radii[:, None] + radii[None])
    return int(connected_components(bonded, directed=False)[0])



@dataclass(frozen=True)
class Step:
    """An optimiser's answer after it was started or told an evaluation: the next geometry to
    compute, or why it stopped (``failure``; "" and no geometry: converged)."""

    proposal: np.ndarray | None  # (natm, 3) Bohr
    failure: str
    seconds: float  # CPU seconds the optimiser took for it


def _started(molecule: Molecule, criteria: Criteria, max_steps: int) -> tuple[ConformerOptimizer | None, Step]:
    start = time.process_time()
    try:
        optimizer = ConformerOptimizer(molecule, criteria, max_steps)
    except Exception as err:  # noqa: BLE001 - this conformer fails, the others go on
        return None, Step(None, f"geomeTRIC could not set up its coordinates: {err}", time.process_time() - start)
    return optimizer, Step(optimizer.proposal(), "", time.process_time() - start)


def _told(optimizer: ConformerOptimizer, energy: float, gradient: np.ndarray) -> Step:
    """Tell ``optimizer`` its evaluation; stop it where geomeTRIC fails or its next geometry is broken."""
    start = time.process_time()
    try:
        optimizer.tell(energy, gradient)
    except Exception as err:  # noqa: BLE001 - geomeTRIC's own failures end this conformer, not the batch
        optimizer.stop(f"geomeTRIC failed at step {optimizer.evaluations}: {type(err).__name__}: {err}".strip())
    proposal = optimizer.proposal()
    if proposal is not None and (problem := structure_problem(optimizer.start, proposal)):
        optimizer.stop(problem)
        proposal = None
    return Step(proposal, optimizer.failure, time.process_time() - start)


class InlineOptimizers:
    """The conformers' optimisers in this process: for a single conformer, where a worker's start
    would cost more than it saves."""

    def __init__(self, criteria: Criteria, max_steps: int):
        self.criteria, self.max_steps = criteria, max_steps
        self.optimizers: dict[int, ConformerOptimizer] = {}
        self.answers: dict[int, Step] = {}

    def start(self, key: int, molecule: Molecule) -> None:
        optimizer, self.answers[key] = _started(molecule, self.criteria, self.max_steps)
        if optimizer is not None:
            self.optimizers[key] = optimizer

    def tell(self, key: int, energy: float, gradient: np.ndarray) -> None:
        self.answers[key] = _told(self.optimizers[key], energy, gradient)

    def answer(self, key: int) -> Step:
        step = self.answers.pop(key)
        if step.proposal is None:
            self.optimizers.pop(key, None)
        return step

    def stop(self, key: int) -> None:
        self.optimizers.pop(key, None)

    def close(self) -> None:
        self.optimizers.clear()


def serve(connection) -> None:
    """A worker process's loop: its settings first, then start and tell the optimisers it holds,
    answering each message with a :class:`Step`, until told None or its parent is gone."""
    optimizers = InlineOptimizers(*connection.recv())
    try:
        while (message := connection.recv()) is not None:
            kind, key, *payload = message
            if kind == "stop":
                optimizers.stop(key)
                continue
            getattr(optimizers, kind)(key, *payload)
            connection.send((key, optimizers.answer(key)))
    except EOFError:  # the main process died: nothing left to answer
        pass


class WorkerOptimizers:
    """The conformers' optimisers spread over worker processes, each conformer's kept in one worker:
    :meth:`start` and :meth:`tell` send, :meth:`answer` waits for that conformer's reply, so the
    workers step many conformers at once while the main process goes on.

    A worker is a new interpreter (:mod:`pyscf_ipu.optimizer_worker`; not a fork of a process with JAX's threads,
    and not multiprocessing's spawn, which would import the caller's own script again), talking
    over a socket pair; it ends when told to or when the main process's end closes the socket."""

    def __init__(self, criteria: Criteria, max_steps: int, workers: int):
        package_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
               "JAX_PLATFORMS": "cpu"}  # a worker never computes with JAX: it must not take an accelerator's memory
        self.connections, self.processes = [], []
        for _ in range(workers):
            ours, theirs = socket.socketpair()
            process = subprocess.Popen([sys.executable, "-m", "pyscf_ipu.optimizer_worker", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)  # fmt: skip
            theirs.close()
            connection = Connection(ours.detach())
            connection.send((criteria, max_steps))
            self.connections.append(connection)
            self.processes.append(process)
        self.home: dict[int, int] = {}  # each conformer's worker
        self.load = [0] * workers
        self.replies: dict[int, Step] = {}

    def start(self, key: int, molecule: Molecule) -> None:
        worker = int(np.argmin(self.load))
        self.home[key] = worker
        self.load[worker] += 1
        self.connections[worker].send(("start", key, molecule))

    def tell(self, key: int, energy: float, gradient: np.ndarray) -> None:
        self.connections[self.home[key]].send(("tell", key, energy, gradient))

    def answer(self, key: int) -> Step:
        connection = self.connections[self.home[key]]
        while key not in self.replies:
            try:
                got, step = connection.recv()
            except EOFError:
                raise RuntimeError("a geomeTRIC worker process died") from None
            self.replies[got] = step
        step = self.replies.pop(key)
        if step.proposal is None:
            self.load[self.home.pop(key)] -= 1
        return step

    def stop(self, key: int) -> None:
        worker = self.home.pop(key)
        self.load[worker] -= 1
        self.connections[worker].send(("stop", key))

    def close(self) -> None:
        for connection in self.connections:
            try:
                connection.send(None)
                connection.close()
            except OSError:  # already gone
                pass
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


def default_workers() -> int:
    """geomeTRIC worker processes: every core but the one the main process dispatches from (one at
    least), at most 16."""
    return max(1, min(16, usable_cores() - 1))


@dataclass(eq=False)  # compared by identity: the slots hold members, not values
class _Member:
    """A conformer in a slot of the batch: its start, its frames so far, its next geometry."""

    index: int
    start: Molecule
    proposal: Molecule
    frames: list[Frame] = field(default_factory=list)
    seconds: float = 0.0
    optimizer_seconds: float = 0.0
    failure: str = ""  # why it stopped in this process (its SCF or its gradient)


@dataclass
class _Half:
    """One half of the batch: its slots (a member or None), what is in flight for it, and which slots
    held the same member in the last evaluation (whose density then seeds the next SCF)."""

    slots: list[_Member | None]
    run: BatchRun | None = None
    pending: object = None  # the gradients in flight (pyscf_ipu.gradients.PendingGradients)
    evaluated: list[_Member | None] = field(default_factory=list)  # the members of the run in flight

    @property
    def active(self) -> list[_Member]:
        return [m for m in self.slots if m is not None]


def relax(molecules: Iterable[Molecule], method: Method, *, criteria: Criteria = Criteria(), max_steps: int = MAX_STEPS,
          width: int | None = None, workers: int | None = None, on_step: Callable[[int, Frame], None] | None = None,
          on_done: Callable[[int, Relaxation], None] | None = None) -> list[Relaxation]:  # fmt: skip
    """Relax conformers ``molecules`` (of one size bucket; an iterable is read as slots free up) under
    ``method``, ``width`` at a time (default: 2), each with its own geomeTRIC optimiser.

    The batch is two halves of ``width // 2`` slots (one of ``width`` where that is 1). On an
    accelerator each stays full, an empty slot computing a copy of a neighbour, so every round runs
    the same programs; on a CPU its batch is as wide as its members (:func:`keeps_width`). A finished
    conformer's slot goes to the next waiting one. The optimisers run in ``workers`` processes
    (default: :func:`default_workers`; 0: in this one). ``on_step(i, frame)`` is called for each
    computed frame of the i-th conformer, ``on_done(i, relaxation)`` as soon as it finishes. Returns
    one :class:`Relaxation` per conformer, in order."""
    width = width or 2
    if width < 1:
        raise ValueError(f"width = {width}: need at least 1")
    workers = default_workers() if workers is None else workers
    pool = WorkerOptimizers(criteria, max_steps, workers) if workers else InlineOptimizers(criteria, max_steps)
    halves = [_Half([None] * (width // 2)), _Half([None] * (width - width // 2))] if width > 1 else [_Half([None])]
    waiting = enumerate(molecules)
    out: dict[int, Relaxation] = {}
    last = time.perf_counter()

    def finish(member: _Member, failure: str) -> None:
        relaxation = Relaxation(tuple(member.frames), failure, member.seconds, member.optimizer_seconds)
        out[member.index] = relaxation
        if on_done is not None:
            on_done(member.index, relaxation)

    def refill(half: _Half) -> None:
        """Fill ``half``'s empty slots from the waiting conformers, while there are any."""
        for slot, member in enumerate(half.slots):
            while member is None:
                index, molecule = next(waiting, (None, None))
                if molecule is None:
                    return
                method.check_elements(molecule.symbols)
                pool.start(index, molecule)
                step = pool.answer(index)
                member = _Member(index, molecule, molecule, optimizer_seconds=step.seconds)
                if step.proposal is None:
                    finish(member, step.failure)
                    member = None
            half.slots[slot] = member

    try:
        for half in halves:
            refill(half)
            _dispatch(half, method)
        while any(h.run is not None for h in halves):
            for half in halves:
                if half.run is None:
                    continue
                results, gradients = _collect(half)
                now = time.perf_counter()
                told = _tell(half, results, gradients, pool, on_step, (now - last) / max(1, len(half.active)))
                last = now
                for member in told:
                    step = pool.answer(member.index)
                    member.optimizer_seconds += step.seconds
                    if step.proposal is None:
                        finish(member, step.failure)
                        half.slots[half.slots.index(member)] = None
                    else:
                        member.proposal = member.start.with_positions(step.proposal)
                for slot, member in enumerate(half.slots):  # stopped here: an SCF or gradient failure
                    if member is not None and member.failure:
                        pool.stop(member.index)
                        finish(member, member.failure)
                        half.slots[slot] = None
                refill(half)
                _dispatch(half, method)
    finally:
        pool.close()
    return [out[i] for i in sorted(out)]


def keeps_width() -> bool:
    """Whether a half's batch keeps its width when slots empty (an empty slot computing a copy of a
    neighbour): on an accelerator, where the copies run beside the rest and a new width would
    compile every program again; not on a CPU, where a copy costs what a conformer does and the
    batch is as wide as its members."""
    return jax.default_backend() != "cpu"


def _dispatch(half: _Half, method: Method) -> None:
    """Start the SCF and the gradients of ``half``'s proposed geometries on the device (none where it
    is empty), each SCF from its conformer's last density where it was in the last batch too."""
    active = half.active
    if not active:
        half.run = half.pending = None
        half.evaluated = []
        return
    evaluated = list(half.slots) if keeps_width() else active  # the batch's members; None: a copy
    molecules = [(m if m is not None else active[0]).proposal for m in evaluated]
    bucket = method.bucket(molecules[0])
    integrals, batch_members, timings = method.integrals.integrals(molecules, bucket, method)
    previous = half.run
    if previous is not None:
        was = {id(m): i for i, m in enumerate(half.evaluated) if m is not None}
        source = np.array([was.get(id(m), -1) if m is not None else -1 for m in evaluated])
        if (source >= 0).any():
            guess = carried_guess(integrals.guess, previous.final.density, np.maximum(source, 0), source >= 0)
            integrals = dataclasses.replace(integrals, guess=guess)
    half.run = submit_batch(batch_of(integrals, batch_members, timings, bucket, method), method)
    half.pending = gradient_source(method).dispatch(half.run, method, [m is not None for m in evaluated])
    half.evaluated = evaluated


@compiled(name="carried_guess", quick_compile=True)
def _carried_guess(guess, previous, source, keep):
    return jnp.where(keep[:, None, None], previous[source], guess)


def carried_guess(guess, previous, source: np.ndarray, keep: np.ndarray):
    """(C, Np, Np) each member's initial density: ``previous[source]`` (the last batch's converged
    density of the same conformer) where ``keep`` (C,), else ``guess``."""
    with jax.enable_x64(True):
        return _carried_guess(guess, previous, source.astype(np.int32), keep)


def _collect(half: _Half) -> tuple[list[SCFResult], list[np.ndarray | None]]:
    """Wait for ``half``'s run; its results, and the gradients of its members whose SCF converged."""
    results = half.run.results()
    usable = [r if m is not None and r.converged and np.isfinite(r.energy) else None
              for m, r in zip(half.evaluated, results)]  # fmt: skip
    return results, half.pending.gradients(usable)


def _tell(half: _Half, results: list[SCFResult], gradients: list, pool, on_step, share: float) -> list[_Member]:
    """Record each evaluated member's frame and send its optimiser the evaluation; returns those told.
    A member whose SCF failed or whose gradient is not finite is not told: it stops with the reason."""
    told = []
    for member, result, gradient in zip(half.evaluated, results, gradients):
        if member is None:  # a copy filling an empty slot
            continue
        member.seconds += share
        step = len(member.frames)
        if gradient is None:
            member.failure = f"SCF not converged at step {step}"
            continue
        if not np.all(np.isfinite(gradient)):
            member.failure = f"gradient not finite at step {step}"
            continue
        frame = Frame(step, member.proposal, result, gradient)
        member.frames.append(frame)
        if on_step is not None:
            on_step(member.index, frame)
        pool.tell(member.index, result.energy, gradient)
        told.append(member)
    return told


__all__ = ["ConformerOptimizer", "Frame", "Relaxation", "default_workers", "relax", "structure_problem"]
