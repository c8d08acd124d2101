"""The ERIs of a batch of conformers from their :mod:`.eri_plan`: the runner of the :mod:`.eri_kernels`.

From host positions, the quartet chunks are dealt out in shares (:func:`_parts`), the first run on
the calling thread and the others on worker threads, each share as one program, because XLA's CPU
backend runs each loop fusion on one core;
every share has the same shapes, so the shares and molecules of similar size run one compiled
program. From JAX positions (the forces differentiate the ERIs), everything is one traced program.
The inputs of each plan are laid out on the device once per batch (:func:`_stacked`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from ..padding import padded_size
from ..programs import compiled, on_device, usable_cores
from .eri_kernels import pair_factors, pair_program, quartet_program
from .eri_plan import NOWHERE, EriPlan, QuartetClass


def eri_s8(plans, coords, dtype=jnp.float32, workers: int | None = None) -> jax.Array:
    """The ERIs packed as PySCF's s8, (C, size), of C conformers at atom positions ``coords``
    (C, natm, 3) in Bohr, computed as one batch. ``plans`` is one :class:`EriPlan` for all
    conformers, or one per conformer: plans of one size bucket (:func:`plan_eri` with the bucket's
    :class:`EriCapacity`), so that conformers of different molecules share the batch; positions
    beyond a molecule's atoms are ignored.

    Host (numpy) positions have their differences formed in float64 on the host: exact zeros within
    an atom, full precision between atoms, and the per-pair Hermite matrices are computed in
    float64 and rounded once (in float32 they carry a systematic error that shifts total energies
    by meV). The quartet chunks are then shared out over ``workers`` threads (default:
    :func:`default_workers`), the calling thread and ``workers - 1`` others, each running its share
    as its own program: XLA's CPU backend runs a loop fusion on one core. A share's output comes
    from the heap of the thread that runs it, and only the calling thread's keeps large freed
    blocks for the next batch (``docs/decisions/memory-reuse.md``).

    JAX positions are differenced on the device and the whole computation runs in ``dtype`` as one
    program (no threads: it may be traced), so the result can be differentiated with respect to
    them (the forces do, in float64).
    """
    plans = [plans] * len(coords) if isinstance(plans, EriPlan) else list(plans)
    first = plans[0]
    natm = max(plan.natm for plan in plans)
    if coords.ndim != 3 or coords.shape[-1] != 3 or not natm <= coords.shape[-2] <= first.padded_natm \
            or len(plans) != coords.shape[0]:  # fmt: skip
        raise ValueError(f"coords has shape {coords.shape}: expected (conformers, {natm}, 3), one plan per conformer")
    if any(_static(plan) != _static(first) or plan.padded_natm != first.padded_natm for plan in plans):
        raise ValueError("conformers computed together need plans of one size bucket")
    dtype = jnp.dtype(dtype)
    extra_atoms = [(0, 0), (0, first.padded_natm - coords.shape[1]), (0, 0)]  # own no shell
    pair_arrays = _stacked(tuple(plans), "pairs", dtype.name if isinstance(coords, jax.Array) else "float64")
    if isinstance(coords, jax.Array):
        workers = 1  # one program: it may be traced
        coords = jnp.pad(coords, extra_atoms)
        shifts = (coords[..., :, None, :] - coords[..., None, :, :]).astype(dtype)
        data = pair_program(_static(first)[0], pair_arrays, shifts, dtype.name)
    else:
        workers = default_workers() if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers = {workers}: need at least 1")
        coords = np.pad(np.asarray(coords, np.float64), extra_atoms)
        difference = coords[..., :, None, :] - coords[..., None, :, :]  # (C, natm, natm, 3)
        shifts = on_device(difference.astype(dtype))
        with jax.enable_x64(True):
            data = pair_program(_static(first)[0], pair_arrays, difference, dtype.name)
    shares = _stacked(tuple(plans), ("quartets", workers), dtype.name)  # (share k's arrays, ...)
    static = _static(first)  # the shares' too: each keeps every quartet class, in order

    def run(k: int) -> jax.Array:
        return quartet_program(static, *shares[k], data, shifts)

    if workers == 1:
        out = _combine((run(0),), first.size)
    else:
        x64 = jax.config.jax_enable_x64  # the caller's, possibly a thread-local jax.enable_x64 context

        def in_thread(k: int) -> jax.Array:
            with jax.enable_x64(x64):  # worker threads do not inherit the caller's context
                return run(k).block_until_ready()  # in this thread: the point is to keep the cores busy at once

        with ThreadPoolExecutor(workers - 1) as pool:  # the first share on this thread
            others = pool.map(in_thread, range(1, workers))
            out = _combine((run(0).block_until_ready(), *others), first.size)
    return out


@partial(compiled, static_argnums=1, name="eri_combine")
def _combine(shares: tuple, size: int) -> jax.Array:
    """The shares' s8 arrays added (each wrote zeros outside its own quartets) and cut to ``size``, in
    one pass (a Python ``sum`` and a slice would copy the batch's array three times)."""
    total = shares[0]
    for share in shares[1:]:
        total = total + share
    return total[..., :size]


def default_workers() -> int:
    """Threads for :func:`eri_s8` from host positions: the cores this process may use on a CPU
    backend (capped at 8), one on an accelerator (where programs queue on one device anyway)."""
    if jax.default_backend() != "cpu":
        return 1
    return min(8, usable_cores())


@lru_cache(maxsize=2)  # the shares copy the plan's destinations
def _parts(plan: EriPlan, workers: int) -> tuple[EriPlan, ...]:
    """``plan`` split into ``workers`` plans with disjoint chunks and equal shapes, so that every share,
    and every molecule of similar size, runs one compiled program.

    The chunks of all classes, in order, are dealt out in turn (balanced to a chunk per class); each
    share's class is then padded to a bucketed common count with chunks that write NOWHERE (the
    kernel skips them). The one-centre constants are dealt out likewise.
    """
    shares: list[list[QuartetClass]] = [[] for _ in range(workers)]
    dealt = 0
    for q in plan.quartets:
        owner = (dealt + np.arange(len(q.chunks))) % workers
        dealt += len(q.chunks)
        count = padded_size(-(-len(q.chunks) // workers), minimum=1)
        for k in range(workers):
            mine = owner == k
            extra = count - int(mine.sum())
            chunks = np.concatenate([q.chunks[mine], np.repeat(q.chunks[:1], extra, axis=0)])
            nowhere = np.full((extra,) + q.destination.shape[1:], NOWHERE, np.int32)
            shares[k].append(QuartetClass(q.bra, q.ket, chunks, np.concatenate([q.destination[mine], nowhere])))
    count = padded_size(-(-plan.one_centre_count // workers), minimum=64)

    def one_centre(values: np.ndarray, k: int, fill) -> np.ndarray:
        mine = values[k::workers]
        return np.pad(mine, (0, count - len(mine)), constant_values=fill)

    return tuple(replace(plan, quartets=tuple(share), one_centre_index=one_centre(plan.one_centre_index, k, NOWHERE),
                         one_centre_value=one_centre(plan.one_centre_value, k, 0.0))
                 for k, share in enumerate(shares))  # fmt: skip


def _static(plan: EriPlan):
    return (tuple((c.la, c.lb) for c in plan.pairs), tuple((q.bra, q.ket) for q in plan.quartets), plan.padded_size)


def _host_arrays(plan: EriPlan, what, dtype: str) -> tuple:
    """One plan's kernel inputs as host arrays: ``"pairs"``, the pair classes' exponent factors
    (``dtype``) and atoms; ``("quartets", workers)``, per share of :func:`_parts`, the chunks, whether
    each has anything to compute, and s8 destinations of every quartet class, and the share's
    one-centre positions and values."""
    if what == "pairs":
        out = []
        for c in plan.pairs:
            factors, p, scale = pair_factors(plan, c)
            atoms = (plan.shells.atom[c.first].astype(np.int32), plan.shells.atom[c.second].astype(np.int32))
            out.append((tuple(np.asarray(f, dtype) for f in factors), np.asarray(p, dtype), np.asarray(scale, dtype))
                       + atoms)  # fmt: skip
        return tuple(out)
    _, workers = what
    return tuple((tuple((q.chunks, (q.destination != NOWHERE).any((1, 2, 3, 4)), q.destination.reshape(-1))
                        for q in part.quartets),
                  (part.one_centre_index, np.asarray(part.one_centre_value, dtype)))
                 for part in _parts(plan, workers))  # fmt: skip


@lru_cache(maxsize=4)  # a batch's arrays: a 6-31G* plan's destinations alone are hundreds of MB
def _stacked(plans: tuple[EriPlan, ...], what, dtype: str):
    """:func:`_host_arrays` of each plan, stacked along a leading conformer axis, on the device once
    per batch of plans (a batch of one molecule's conformers reuses them)."""
    per_plan = {id(plan): _host_arrays(plan, what, dtype) for plan in plans}
    members = [per_plan[id(plan)] for plan in plans]
    return on_device(jax.tree.map(lambda *xs: np.stack(xs), *members))  # one transfer, no per-array program
