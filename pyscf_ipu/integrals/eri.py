"""The ERIs of a batch of conformers from one :mod:`.eri_plan`: the runner of the :mod:`.eri_kernels`.

A plan fixes which shell quartets are computed and where their values go; the conformers bring their
positions and, where the plan is a size bucket's template (:mod:`pyscf_ipu.templates`), their own
shells' exponents and coefficients and one-centre integrals (the elements that fill its slots). From
concrete positions, the quartet chunks are dealt out in shares (:func:`_parts`), the first run on the
calling thread and the others on worker threads, each share as one program, because XLA's CPU backend
runs each loop fusion on one core; every share has the same shapes, so the shares run one compiled
program. From traced positions (the forces differentiate the ERIs), everything is one traced program.
A plan's own arrays go to the device once (:func:`eri_structure`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..padding import padded_size
from ..programs import compiled, members_at_once, on_device, usable_cores
from .eri_kernels import pair_program, quartet_member_bytes, quartet_program
from .eri_plan import NOWHERE, EriPlan, QuartetClass, pair_rows


class ShellValues(NamedTuple):
    """What a plan's conformers bring besides their positions: (C, ...) arrays of each conformer's
    shells and one-centre integrals in the plan's layout (float64), and which of the plan's atoms
    are there (a size bucket's template leaves some slots absent: their quartets are skipped)."""

    exponents: np.ndarray | jax.Array  # (C, S, K)
    coefficients: np.ndarray | jax.Array  # (C, S, C', K)
    one_centre: np.ndarray | jax.Array  # (C, M)  the integrals with all four AOs on one atom
    present: np.ndarray | jax.Array  # (C, natm) bool


def plan_values(plan: EriPlan, conformers: int) -> ShellValues:
    """The plan's own values (its molecule's elements, all its atoms) for ``conformers`` conformers; the
    one-centre integrals padded with zeros to the plan's capacity (one shape for similar molecules)."""
    shells = plan.shells
    one_centre = np.pad(plan.one_centre_value, (0, plan.one_centre_count - len(plan.one_centre_value)))
    values = (shells.exponents, shells.coefficients, one_centre, np.ones(plan.padded_natm, bool))
    return ShellValues(*(np.broadcast_to(v, (conformers,) + v.shape) for v in values))


def eri_s8(plan: EriPlan, coords, dtype=jnp.float32, workers: int | None = None, values: ShellValues | None = None,
           share: tuple | None = None, omega: float | None = None, threshold: float = 0.0) -> jax.Array:  # fmt: skip
    """The ERIs packed as PySCF's s8, (C, size), of C conformers at atom positions ``coords``
    (C, natm, 3) in Bohr, computed as one batch under ``plan``; positions beyond the plan's atoms are
    ignored. ``values`` (default: the plan's own) are each conformer's shells and one-centre
    integrals: a size bucket's template plan serves every molecule of the bucket so.

    Concrete positions (numpy, or a device array) have their differences formed in float64 and the
    per-pair Hermite matrices computed in float64 and rounded once (in float32 they carry a
    systematic error that shifts total energies by meV). The quartet chunks are then shared out over
    ``workers`` threads (default: :func:`default_workers`), the calling thread and ``workers - 1``
    others, each running its share as its own program: XLA's CPU backend runs a loop fusion on one
    core. A share's output comes from the heap of the thread that runs it, and only the calling
    thread's keeps large freed blocks for the next batch (``docs/decisions/memory-reuse.md``).

    Traced positions are differenced in ``dtype`` and the whole computation is one program (no
    threads), so the result can be differentiated with respect to them (the forces do). ``share``, one
    share's tables from :func:`eri_shares` (default: every quartet in one share), then computes only
    that share's quartets (zeros elsewhere), so that n threads can each differentiate one; passed in
    as an argument of the caller's program, not a constant, it lets the n shares, all of one shape,
    run one compiled program. ``omega`` (default: the plan's) is the operator's range separation: 0
    for 1/r, else the long-range erf(ω r)/r, whose one-centre integrals ``values`` must then hold.
    ``threshold`` > 0 screens: chunks of quartets whose Schwarz bounds multiply to less are not
    computed (:func:`~.eri_kernels.quartet_stage`).
    """
    if coords.ndim != 3 or coords.shape[-1] != 3 or not plan.natm <= coords.shape[-2] <= plan.padded_natm:
        raise ValueError(f"coords has shape {coords.shape}: expected (conformers, {plan.natm}, 3)")
    values = plan_values(plan, coords.shape[0]) if values is None else values
    dtype = jnp.dtype(dtype)
    static = static_tables(plan, omega, threshold)
    extra_atoms = [(0, 0), (0, plan.padded_natm - coords.shape[1]), (0, 0)]  # own no shell
    exponents, coefficients, one_centre, present = at_counts(values, computed_counts(plan))
    at_once = members_at_once(coords.shape[0], quartet_member_bytes(static, plan.pairs, dtype.itemsize))
    if isinstance(coords, jax.core.Tracer):
        coords = jnp.pad(coords, extra_atoms)
        data, shifts = pair_program(static[0], eri_structure(plan), (exponents, coefficients), coords, present,
                                    dtype.name)  # fmt: skip
        index, selection, arrays = eri_shares(plan, 1)[0] if share is None else share
        return quartet_program(static, arrays, (index, selection, one_centre), data, shifts, eri_rows(plan),
                               at_once)[..., : plan.size]  # fmt: skip
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers = {workers}: need at least 1")
    if coords.shape[1] != plan.padded_natm:
        coords = np.pad(np.asarray(coords), extra_atoms)
    with jax.enable_x64(True):
        data, shifts = pair_program(static[0], eri_structure(plan), (exponents, coefficients), coords, present,
                                    dtype.name)  # fmt: skip
    shares = eri_shares(plan, workers)

    def run(k: int) -> jax.Array:
        index, selection, arrays = shares[k]
        return quartet_program(static, arrays, (index, selection, one_centre), data, shifts, eri_rows(plan), at_once)

    if workers == 1:
        return _combine((run(0),), plan.size)
    x64 = jax.config.jax_enable_x64  # the caller's, possibly a thread-local jax.enable_x64 context

    def in_thread(k: int) -> jax.Array:
        with jax.enable_x64(x64):  # worker threads do not inherit the caller's context
            return run(k).block_until_ready()  # in this thread: the point is to keep the cores busy at once

    with ThreadPoolExecutor(workers - 1) as pool:  # the first share on this thread
        others = pool.map(in_thread, range(1, workers))
        return _combine((run(0).block_until_ready(), *others), plan.size)


def device_tables(plan: EriPlan, workers: int) -> None:
    """Build, outside any trace, the device tables :func:`eri_s8` keeps for ``plan`` and its quartets
    in ``workers`` shares: made inside a ``jax.jit`` trace, the cache would keep that trace's values."""
    static_tables(plan)
    eri_structure(plan)
    eri_rows(plan)
    eri_shares(plan, workers)


def computed_counts(plan: EriPlan) -> tuple[int, int, int]:
    """(shells, one-centre constants, atoms): the counts along which :class:`ShellValues` reach the
    plan's programs."""
    return plan.padded_shells, plan.one_centre_count, plan.padded_natm


def at_counts(values: ShellValues, counts: tuple[int, int, int]) -> ShellValues:
    """``values`` extended along their second axis to ``counts`` (:func:`computed_counts`): shells with
    exponents 1 (no pair reads them, and none divides by zero), one-centre constants 0, atoms absent.
    Values already at the counts are returned as they are."""
    shells, one_centre, natm = counts
    targets = ((shells, 1), (shells, 0), (one_centre, 0), (natm, False))
    return ShellValues(*(_extended(v, n, fill) for v, (n, fill) in zip(values, targets)))


def _extended(values, count: int, fill):
    """``values`` (C, n, ...) extended to (C, count, ...) with ``fill``."""
    extra = count - values.shape[1]
    if not extra:
        return values
    xp = np if isinstance(values, np.ndarray) else jnp
    return xp.concatenate([values, xp.full((values.shape[0], extra) + values.shape[2:], fill, values.dtype)], axis=1)


@partial(compiled, static_argnums=1, name="eri_combine", quick_compile=True)
def _combine(shares: tuple, size: int) -> jax.Array:
    """The shares' s8 arrays added (each wrote zeros outside its own quartets) and cut to ``size``, in
    one pass (a Python ``sum`` and a slice would copy the batch's array three times)."""
    total = shares[0]
    for share in shares[1:]:
        total = total + share
    return total[..., :size]


GPU_CHUNK_BATCH = 32  # chunks an accelerator computes at once (a CPU: one, which stays in its cache)


def chunk_batch() -> int:
    """How many quartet chunks a kernel's map computes at once: one on a CPU (a chunk's arrays then
    stay cache-sized), :data:`GPU_CHUNK_BATCH` on an accelerator (which needs the parallel work)."""
    return 1 if jax.default_backend() == "cpu" else GPU_CHUNK_BATCH


SHARED_ERI_AOS = 16  # on a CPU, hydrogen-like kinds' capacities in ERI programs: multiples of 16 AOs' worth
SHARED_ERI_MOST = 1 << 23  # s8 entries beyond which a bucket keeps its own ERI programs (the padding's memory)


def shared_eri_aos() -> int:
    """The step (in AOs' worth of atoms) to which a size bucket's ERI programs round up the capacities
    of its kinds of fewer than 4 AOs per atom (:meth:`~pyscf_ipu.buckets.SizeBucket.widened`), so that
    buckets that differ only in hydrogens share them: :data:`SHARED_ERI_AOS` on a CPU, where the extra
    chunks are skipped at run time; 0 (each bucket its own) on an accelerator, whose map vmaps the
    chunks and so computes every one (:func:`chunk_batch`)."""
    return SHARED_ERI_AOS if jax.default_backend() == "cpu" else 0


def default_workers() -> int:
    """Threads for :func:`eri_s8` from concrete positions: the cores this process may use on a CPU
    backend (capped at 8), one on an accelerator (where programs queue on one device anyway)."""
    if jax.default_backend() != "cpu":
        return 1
    return min(8, usable_cores())


class Share(NamedTuple):
    """The part of a plan one worker computes: its chunks of every quartet class (padded to a common
    count with chunks that have no values), which of them are its own (not that padding), and its
    one-centre integrals' positions and their places in the plan's one-centre list (the padding:
    NOWHERE, and one past the list's end)."""

    quartets: tuple[QuartetClass, ...]
    one_centre_index: np.ndarray  # (m,) int32
    one_centre_selection: np.ndarray  # (m,) int32
    dealt: tuple[np.ndarray, ...]  # per class (T,) bool


def _parts(plan: EriPlan, workers: int) -> tuple[Share, ...]:
    """``plan`` split into ``workers`` shares with disjoint chunks and equal shapes, so that every share,
    and every molecule of similar size, runs one compiled program.

    The chunks of all classes, in order, are dealt out in turn (balanced to a chunk per class); each
    share's class is then padded to a rounded-up common count with copies of its first chunk that are
    not the share's own (the kernel skips them and writes nothing of them). The one-centre integrals
    are dealt out likewise.
    """
    shares: list[list[QuartetClass]] = [[] for _ in range(workers)]
    own: list[list[np.ndarray]] = [[] for _ in range(workers)]
    dealt = 0
    for q in plan.quartets:
        owner = (dealt + np.arange(len(q.chunks))) % workers
        dealt += len(q.chunks)
        count = padded_size(-(-len(q.chunks) // workers), minimum=1)
        for k in range(workers):
            mine = owner == k
            extra = count - int(mine.sum())
            chunks = np.concatenate([q.chunks[mine], np.repeat(q.chunks[:1], extra, axis=0)])
            nothing = np.zeros((extra,) + q.keep.shape[1:], bool)
            shares[k].append(QuartetClass(q.bra, q.ket, chunks, np.concatenate([q.keep[mine], nothing])))
            own[k].append(np.arange(count) < count - extra)
    total = len(plan.one_centre_index)
    count = padded_size(-(-plan.one_centre_count // workers), minimum=64)

    def dealt_to(values: np.ndarray, k: int, fill) -> np.ndarray:
        mine = values[k::workers]
        return np.pad(mine, (0, count - len(mine)), constant_values=fill).astype(np.int32)

    return tuple(Share(tuple(share), dealt_to(plan.one_centre_index, k, NOWHERE), dealt_to(np.arange(total), k, total),
                       tuple(own[k])) for k, share in enumerate(shares))  # fmt: skip


def static_tables(plan: EriPlan, omega: float | None = None, threshold: float = 0.0):
    """The plan's compile-time part: each pair class's (l_a, l_b, K_a, K_b), each quartet class's
    (bra, ket), the s8 array's padded length, how many chunks the map computes at once
    (:func:`chunk_batch`), the operator's range separation ω (0: Coulomb; default: the plan's) and
    the screening threshold (0: none)."""
    return (tuple((c.la, c.lb, c.ka, c.kb) for c in plan.pairs), tuple((q.bra, q.ket) for q in plan.quartets),
            plan.padded_size, chunk_batch(), float(plan.omega if omega is None else omega),
            float(threshold))  # fmt: skip


@lru_cache(maxsize=4)
def eri_structure(plan: EriPlan) -> tuple:
    """The pair stage's index arrays on the device: per pair class (first shells, second shells,
    their atoms)."""
    atom = plan.shells.atom
    return on_device(tuple((c.first.astype(np.int32), c.second.astype(np.int32), atom[c.first].astype(np.int32),
                            atom[c.second].astype(np.int32)) for c in plan.pairs))  # fmt: skip


@lru_cache(maxsize=4)
def eri_shares(plan: EriPlan, workers: int) -> tuple:
    """Per share of :func:`_parts`, on the device: (one-centre positions, their selection, and per
    quartet class the chunks, whether each has anything to compute in the plan's row order and
    whether it is the share's own). The kernels work out the destinations (:func:`eri_rows`)."""
    return on_device(tuple((share.one_centre_index, share.one_centre_selection,
                            tuple((q.chunks, q.keep.any((1, 2)), dealt)
                                  for q, dealt in zip(share.quartets, share.dealt)))
                           for share in _parts(plan, workers)))  # fmt: skip


@lru_cache(maxsize=4)
def eri_rows(plan: EriPlan) -> tuple:
    """Per pair class, on the device, what the kernels need to place its rows' values
    (:func:`~.eri_kernels.chunk_destinations`): each value's packed AO pair and whether it repeats
    another of its row (S, R), the atom the row's two shells share (-1 if none) and whether the row is
    a real pair, not padding (R,)."""
    atom = plan.shells.atom
    out = []
    for c in plan.pairs:
        aos, repeat = pair_rows(plan.shells, c)
        shared = np.where(atom[c.first] == atom[c.second], atom[c.first], -1)
        out.append((aos.astype(np.int32), repeat, shared.astype(np.int32), np.arange(len(c.first)) < c.count))
    return on_device(tuple(out))
