"""Batched geometry optimisation: many conformers relaxed at once, each by an optimiser of its own.

Each conformer keeps its own geomeTRIC optimiser (Wang and Song, J. Chem. Phys. 144, 214108 (2016)):
translation-rotation internal coordinates (TRIC), a BFGS Hessian from a model guess, a trust radius,
its own convergence test and step count. geomeTRIC normally drives its own loop and asks an engine
for one energy at a time; here the loop is turned inside out. Every round, each unfinished
optimiser proposes a geometry (:meth:`ConformerOptimizer.proposal`), the proposals are computed as
one batched SCF on the device, each starting from its own previous density, and each optimiser is
told its energy and gradient (:meth:`ConformerOptimizer.tell`). A finished conformer leaves the
batch and the next waiting one takes its place (:func:`relax`).

The gradient includes the grid's response (:func:`~pyscf_ipu.forces.nuclear_gradient` with
``grid_response=True``): at a coarse grid the energy and a fixed-grid gradient disagree enough to
trap an optimiser. The SCF continues in float64 to converged orbitals (``RKSConfig.for_forces``), so
that energy differences are meaningful at geomeTRIC's 1e-6 Hartree criterion.

Why geomeTRIC and internal coordinates rather than a first-order optimiser in Cartesians:
``docs/decisions/batched-relaxation.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .config import MAX_STEPS, Criteria
from .forces import nuclear_gradient
from .method import Method
from .molecule import Molecule
from .padding import fill_batch
from .problem import batch_of
from .pyscf_mole import check_basis
from .results import SCFResult
from .rks import submit_batch
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


@dataclass
class _Member:
    """A conformer in the batch: its optimiser, its frames so far and its last density."""

    index: int
    optimizer: ConformerOptimizer
    frames: list[Frame] = field(default_factory=list)
    density: np.ndarray | None = None  # (N, N) the last step's converged density: the next SCF's guess
    seconds: float = 0.0


def relax(molecules: list[Molecule], method: Method, *, criteria: Criteria = Criteria(), max_steps: int = MAX_STEPS,
          width: int | None = None, on_step: Callable[[int, Frame], None] | None = None) -> list[Relaxation]:
    """Relax conformers ``molecules`` (of one size bucket) under ``method``, ``width`` at a time on the
    device (default: all), each with its own optimiser (:class:`ConformerOptimizer`). A round computes
    every unfinished conformer's proposed geometry as one batch, of ``width`` or, once fewer are left,
    the smallest power of two that holds them (filled up with copies), so that a few programs serve
    every round; a finished conformer's place goes to the next waiting one.
    ``on_step(i, frame)`` is called for each computed frame of ``molecules[i]``. Returns one
    :class:`Relaxation` per molecule, in order."""
    check_basis({symbol for molecule in molecules for symbol in molecule.symbols}, method.config.basis)
    width = width or len(molecules)
    waiting = deque(enumerate(molecules))
    active: list[_Member] = []
    out: dict[int, Relaxation] = {}
    while waiting or active:
        while waiting and len(active) < width:
            index, molecule = waiting.popleft()
            try:
                active.append(_Member(index, ConformerOptimizer(molecule, criteria, max_steps)))
            except Exception as err:  # noqa: BLE001 - this conformer fails, the others go on
                out[index] = Relaxation((), f"geomeTRIC could not set up its coordinates: {err}", 0.0)
        if not active:
            continue
        start = time.perf_counter()
        proposed = [m.optimizer.start.with_positions(m.optimizer.proposal()) for m in active]
        # the batch shrinks by halves as conformers finish: fewer copies fill it, few programs serve it
        results = _scf(proposed, [m.density for m in active], method, min(width, 1 << (len(active) - 1).bit_length()))
        share = (time.perf_counter() - start) / len(active)
        for member, molecule, result in zip(active, proposed, results):
            started = time.perf_counter()
            _advance(member, molecule, result, method, on_step)
            member.seconds += share + time.perf_counter() - started
        for member in [m for m in active if m.optimizer.finished]:
            active.remove(member)
            out[member.index] = Relaxation(tuple(member.frames), member.optimizer.failure, member.seconds)
    return [out[i] for i in range(len(molecules))]


def _advance(member: _Member, molecule: Molecule, result: SCFResult, method: Method,
             on_step: Callable[[int, Frame], None] | None) -> None:  # fmt: skip
    """Tell ``member``'s optimiser its energy and gradient at ``molecule`` (``result``), or stop it."""
    optimizer = member.optimizer
    if not (result.converged and np.isfinite(result.energy)):
        return optimizer.stop(f"SCF not converged at step {optimizer.evaluations}")
    gradient = nuclear_gradient(molecule, result, method, grid_response=True)
    if not np.all(np.isfinite(gradient)):
        return optimizer.stop(f"gradient not finite at step {optimizer.evaluations}")
    frame = Frame(optimizer.evaluations, molecule, result, gradient)
    member.frames.append(frame)
    member.density = result.density
    if on_step is not None:
        on_step(member.index, frame)
    try:
        optimizer.tell(result.energy, gradient)
    except Exception as err:  # noqa: BLE001 - geomeTRIC's own failures end this conformer, not the batch
        return optimizer.stop(f"geomeTRIC failed at step {frame.step}: {type(err).__name__}: {err}".strip())
    proposal = optimizer.proposal()
    if proposal is not None and (problem := structure_problem(optimizer.start, proposal)):
        optimizer.stop(problem)


def _scf(molecules: list[Molecule], densities: list[np.ndarray | None], method: Method, width: int
         ) -> list[SCFResult]:  # fmt: skip
    """The SCF of conformers ``molecules`` as one batch of ``width`` (filled up), each starting from
    its density in ``densities`` where it has one (else the run's guess)."""
    import jax

    bucket = method.bucket(molecules[0])
    filled = fill_batch(molecules, width)
    integrals, members, timings = method.integrals.integrals(filled, bucket, method)
    if any(d is not None for d in densities):
        with jax.enable_x64(True):
            guess = np.array(integrals.guess)  # (C, Np, Np) float64
            for slot, (member, density) in enumerate(zip(members, densities)):
                if density is not None:
                    guess[slot][np.ix_(member.aos, member.aos)] = density
            integrals = dataclasses.replace(integrals, guess=jax.device_put(guess))
    return submit_batch(batch_of(integrals, members, timings, bucket, method), method).results()[: len(molecules)]


__all__ = ["ConformerOptimizer", "Frame", "Relaxation", "relax", "structure_problem"]
