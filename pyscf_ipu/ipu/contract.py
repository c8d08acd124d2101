"""The executor: a tile plan laid out as arrays, and its bulk-synchronous steps in JAX.

Every array has a leading (IPU, tile) pair of axes: ``(num_ipus, T, L, ...)`` where T is the number
of tiles an IPU uses and L the largest per-tile share. Only the last used tile of each IPU is
ragged; its padding holds zero integrals (s8) or zero rows (rows), which add nothing, and the
profile counts real items only (from the plan, not from the padded arrays).

One J-K build is:

1. compute: every tile works on its own arrays and the replicated density (``vmap`` over tiles);
2. exchange: the tiles' results are combined on each IPU (a sum of private accumulators, or the
   gather of row blocks), then across IPUs.

With at least ``num_ipus`` JAX devices (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
on a CPU), each simulated IPU runs on its own device under ``shard_map``, and the IPU-Link
exchange is a ``psum`` (s8) or an ``all_gather`` (rows). Otherwise the IPU axis is vmapped too.
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..packed import (degeneracy_weights, host_row_matrix, pair_index, row_matrix, s8_accumulate, s8_to_s4, symmetrise,
                      tril_unpack)
from ..packed import PackedERI, unique_quartets, unpack_pairs
from ..programs import compiled, on_device
from .plan import TilePlan

IPU_AXIS = "ipu"


def _tile_blocks(shape_plan: TilePlan, items: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Cut ``rows`` (total, ...) into ``items`` per (IPU, tile), in arrays shaped by ``shape_plan``.

    ``items`` (num_ipus, tiles) is the real distribution; ``shape_plan`` (a plan of the padded
    problem, with at least as much per IPU and per tile) fixes the array shape (num_ipus, T, L, ...)
    so that every molecule of a shape bucket gets the same one. The rest is zero padding.
    """
    shape = tile_shape(shape_plan)
    tiles = shape[1]
    out = np.zeros(shape + rows.shape[1:], rows.dtype)
    start = 0
    for ipu in range(shape_plan.num_ipus):
        for tile, count in enumerate(items[ipu, :tiles]):
            out[ipu, tile, :count] = rows[start : start + count]
            start += count
    assert start == len(rows), "the distribution must place every item"
    return out


def tile_shape(plan: TilePlan) -> tuple[int, int, int]:
    """(num_ipus, T, L): IPUs, tiles used per IPU (the most of any IPU), items on the fullest tile."""
    return plan.num_ipus, int(np.count_nonzero(plan.items, axis=1).max()), plan.max_items


def _order(plan: TilePlan) -> np.ndarray:
    """Positions of the real rows, in order, within the flattened (num_ipus, T, L) output."""
    _, tiles, slots = tile_shape(plan)
    mask = np.arange(slots)[None, None, :] < plan.items[:, :tiles, None]
    return np.flatnonzero(mask.reshape(-1)).astype(np.int32)


def row_placement(plan: TilePlan) -> tuple[tuple[int, int, int], ...]:
    """Per IPU, (first row, rows per tile, rows) of a ``rows`` plan: the balanced split fills an
    IPU's tiles in turn, each full but its last (see ``plan.split_even``), so an IPU's rows are one
    contiguous run cut into equal tiles. Static (hashable): the layout becomes slices and pads."""
    out, start = [], 0
    for counts in plan.items:
        used = counts[counts > 0]
        per = int(used[0]) if len(used) else 1
        if np.any(used[:-1] != per):
            raise ValueError("a rows plan must fill every tile of an IPU but its last")
        out.append((start, per, int(used.sum())))
        start += int(used.sum())
    return tuple(out)


def row_source(plan: TilePlan) -> np.ndarray:
    """The inverse of :func:`_order`: which row each (IPU, tile, slot) holds, -1 for padding."""
    order = _order(plan)
    source = np.full(int(np.prod(tile_shape(plan))), -1, np.int32)
    source[order] = np.arange(len(order), dtype=np.int32)
    return source


def layout(shape_plan: TilePlan, real_plan: TilePlan, eri: PackedERI, dtype) -> dict[str, np.ndarray]:
    """The arrays that :func:`contract` reads, for one conformer's ``eri``.

    ``shape_plan`` plans the padded problem (``nao_padded`` AOs; for s8 a bucketed integral count)
    and fixes every array's shape; ``real_plan`` (same strategy and IPUs, the molecule's own sizes)
    decides which integrals each tile holds (s8). Rows of padded AOs are zero rows of the padded
    matrix, so rows follow ``shape_plan``.
    """
    if shape_plan.strategy.name == "rows":
        # padded AOs' pairs last; cast on the host: half the bytes to send to a device
        rows = tiled_rows(eri.s8.astype(dtype)[None], row_placement(shape_plan), eri.nao, shape_plan.workload.nao,
                          dtype)  # fmt: skip
        return jax.tree.map(lambda a: a[0], {"rows": rows, **_shared_rows_arrays(shape_plan, 1)})
    values, index = unique_quartets(eri.s8, eri.nao)
    values = (values * degeneracy_weights(index)).astype(dtype)
    return {
        "values": _tile_blocks(shape_plan, real_plan.items, values),
        "index": _tile_blocks(shape_plan, real_plan.items, index),
    }


def rows_layout(shape_plan: TilePlan, eris: jax.Array, dtype) -> dict:
    """:func:`layout` of a batch's ERIs ``eris`` (C, s8 size), the s8 arrays of the plan's padded AOs
    (padded AOs' integrals zero), for a ``rows`` plan: the row blocks of all of them in ``dtype``
    (:func:`tiled_rows`); the index arrays the contraction reads are the plan's."""
    npad = shape_plan.workload.nao
    rows = tiled_rows(eris, row_placement(shape_plan), npad, npad, dtype)
    return {"rows": rows, **_shared_rows_arrays(shape_plan, rows.shape[0])}


def rows_on_host() -> bool:
    """Whether :func:`tiled_rows` builds the row blocks with numpy: where the device is this CPU, whose
    XLA gathers run one element at a time on one core (``docs/decisions/rows-layout.md``)."""
    return jax.default_backend() == "cpu"


def tiled_rows(s8, placement, nao: int, nao_padded: int, dtype) -> jax.Array:
    """The row blocks (B, num_ipus, T, L, npair_pad) in ``dtype`` of a batch of s8 arrays (B, size),
    numpy's or the device's, on the device: built on the host where :func:`rows_on_host`
    (:func:`host_tiled_rows`), else by the device's programs (:func:`device_tiled_rows`); the same
    values either way."""
    if rows_on_host():
        return on_device(host_tiled_rows(np.asarray(s8), placement, nao, nao_padded, dtype))
    return device_tiled_rows(jnp.asarray(s8), placement, nao, nao_padded, np.dtype(dtype).name)


def host_tiled_rows(s8: np.ndarray, placement, nao: int, nao_padded: int, dtype) -> np.ndarray:
    """:func:`device_tiled_rows` on the host (:func:`~pyscf_ipu.packed.host_row_matrix`): the same array,
    (B, num_ipus, T, L, npair_pad) in ``dtype``. Where the IPUs' runs fill their tiles exactly (one
    IPU, the usual case) each conformer's row matrix is built in place; else it is cut into them."""
    npair_pad = nao_padded * (nao_padded + 1) // 2
    per_ipu = max(-(-count // per) for _, per, count in placement)  # T
    slots = max(per for _, per, _ in placement)  # L
    out = np.empty((len(s8), len(placement), per_ipu, slots, npair_pad), dtype)
    if len(placement) == 1 and per_ipu * slots == placement[0][2]:
        for member, one in zip(out, s8):
            host_row_matrix(one, nao, member.reshape(2 * npair_pad, npair_pad))
        return out
    out[...] = 0.0
    matrix = np.empty((2 * npair_pad, npair_pad), dtype)
    for member, one in zip(out, s8):
        host_row_matrix(one, nao, matrix)
        for tiles, (start, per, count) in zip(member, placement):  # an IPU's run of rows, cut into tiles
            full, rest = divmod(count, per)
            tiles[:full, :per] = matrix[start : start + full * per].reshape(full, per, -1)
            if rest:
                tiles[full, :rest] = matrix[start + full * per : start + count]
    return out


@lru_cache(maxsize=8)
def _shared_rows_arrays(shape_plan: TilePlan, batch: int) -> dict:
    """The ``rows`` strategy's index arrays for a batch of ``batch`` conformers, on the device once."""
    npad = shape_plan.workload.nao
    npair_pad = npad * (npad + 1) // 2
    i, j = tril_unpack(np.arange(npair_pad))  # the AOs of each pair
    shared = {
        "order": _order(shape_plan),  # (2 npair_pad,)
        "pair_aos": np.stack([i, j]).astype(np.int32),  # (2, npair_pad)
        "pairs": pair_index(npad),  # (Np, Np)
    }
    return on_device({k: np.ascontiguousarray(np.broadcast_to(v, (batch,) + v.shape)) for k, v in shared.items()})


def device_tiled_rows(s8, placement, nao: int, nao_padded: int, dtype: str) -> jax.Array:
    """:func:`~pyscf_ipu.packed.row_matrix` of a batch of s8 arrays (B, size), laid out
    (B, num_ipus, T, L, npair_pad) by the IPUs' row runs ``placement`` (:func:`row_placement`),
    which fix the plan's :func:`tile_shape` too: T tiles for the longest run, L rows for the fullest tile.

    Two programs: the s4 unpacking in ``dtype`` on its own, so that it is materialised once, and the
    rows placed by slices and pads (``docs/decisions/rows-layout.md``)."""
    return _placed_rows(_unpacked(s8, nao * (nao + 1) // 2, dtype), placement, nao, nao_padded)


@partial(compiled, static_argnums=(1, 2))
def _unpacked(s8, npair: int, dtype: str) -> jax.Array:
    """(B, npair, npair) s4 in ``dtype`` of a batch of s8 arrays (in any precision: rounded here)."""
    return jax.vmap(s8_to_s4, in_axes=(0, None))(s8.astype(dtype), npair)


@partial(compiled, static_argnums=(1, 2, 3))
def _placed_rows(s4, placement, nao: int, nao_padded: int) -> jax.Array:
    """The row matrices of ``s4`` (B, npair, npair) cut into the tiles' row blocks (see :func:`device_tiled_rows`)."""
    matrix = jax.vmap(row_matrix, in_axes=(0, None, None))(s4, nao, nao_padded)  # (B, 2 npair_pad, npair_pad)
    batch, width = matrix.shape[:-2], matrix.shape[-1]
    per_ipu = max(-(-count // per) for _, per, count in placement)  # T
    slots = max(per for _, per, _ in placement)  # L
    blocks = []
    for start, per, count in placement:  # an IPU's run of rows, cut into tiles of ``per`` rows
        run = matrix[..., start : start + count, :]
        used = -(-count // per)
        run = jnp.pad(run, [(0, 0)] * len(batch) + [(0, used * per - count), (0, 0)])
        run = run.reshape(batch + (used, per, width))
        blocks.append(jnp.pad(run, [(0, 0)] * len(batch) + [(0, per_ipu - used), (0, slots - per), (0, 0)]))
    return jnp.stack(blocks, axis=len(batch))


def place(data: dict, num_ipus: int) -> dict:
    """Put the per-IPU arrays on their devices when there are enough; else leave them uncommitted."""
    devices = jax.devices()
    if num_ipus == 1 or len(devices) < num_ipus:
        return on_device(data)
    sharding = NamedSharding(Mesh(devices[:num_ipus], (IPU_AXIS,)), P(IPU_AXIS))
    per_ipu = {"rows", "values", "index"}
    return {k: jax.device_put(v, sharding if k in per_ipu else None) for k, v in data.items()}


def _rows_compute(rows, dm_pairs):
    """Compute step of one IPU: (T, L, npair) row blocks x replicated density pairs -> (T, L).

    Float32 rows with a float64 density (the finalisation's J and K) are widened as they are read,
    in one fused multiply-and-sum: a matmul would first write a float64 copy of every row.
    """
    if rows.dtype != dm_pairs.dtype:
        return jnp.sum(rows.astype(dm_pairs.dtype) * dm_pairs, axis=-1)
    return jax.vmap(lambda block: block @ dm_pairs)(rows)


def _s8_compute(values, index, dm):
    """Compute step of one IPU: private accumulators per tile, summed on the IPU -> (2, N, N)."""
    partials = jax.vmap(s8_accumulate, in_axes=(0, 0, None))(values, index, dm)  # (T, 2, N, N)
    return partials.sum(axis=0)


def contract(data: dict, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """One J-K build of a laid-out plan: (J, K), each (Np, Np) like ``dm``."""
    rows_strategy = "rows" in data
    num_ipus = (data["rows"] if rows_strategy else data["values"]).shape[0]
    devices = jax.devices()
    sharded = num_ipus > 1 and len(devices) >= num_ipus
    if rows_strategy:
        dm_pairs = dm[data["pair_aos"][0], data["pair_aos"][1]]  # (npair,)  replicated to every tile
        if sharded:
            step = jax.shard_map(
                lambda r, d: jax.lax.all_gather(_rows_compute(r[0], d), IPU_AXIS, tiled=False),
                mesh=Mesh(devices[:num_ipus], (IPU_AXIS,)),
                in_specs=(P(IPU_AXIS), P()),
                out_specs=P(),
                check_vma=False,
            )
            out = step(data["rows"], dm_pairs)
        else:
            out = jax.vmap(_rows_compute, in_axes=(0, None))(data["rows"], dm_pairs)
        flat = out.reshape(-1)[data["order"]]  # exchange: gather the row results in order
        npair = flat.shape[0] // 2
        return unpack_pairs(flat[:npair], data["pairs"]), unpack_pairs(flat[npair:], data["pairs"])
    if sharded:
        step = jax.shard_map(
            lambda v, i, d: jax.lax.psum(_s8_compute(v[0], i[0], d), IPU_AXIS),
            mesh=Mesh(devices[:num_ipus], (IPU_AXIS,)),
            in_specs=(P(IPU_AXIS), P(IPU_AXIS), P()),
            out_specs=P(),
        )
        partials = step(data["values"], data["index"], dm)
    else:
        partials = jax.vmap(_s8_compute, in_axes=(0, 0, None))(data["values"], data["index"], dm).sum(axis=0)
    return symmetrise(partials)
