"""Shared shapes: counts rounded up to a few padded sizes, so that compiled code is reused across
molecules, and the arrays padded to them.

A jitted function compiles once per input shape. Rounding a count (stored integrals, primitives,
ERI chunks) up to :func:`padded_size` makes many molecules share one compiled program; the padded
entries carry zero weight (grid), zero integrals (ERI) or are kept as empty virtual orbitals (AOs).
A molecule's AO and grid shapes come from its size bucket (:mod:`pyscf_ipu.buckets`) instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .programs import on_device


def padded_size(n: int, minimum: int = 8, steps_per_octave: int = 8) -> int:
    """Round ``n`` up to a multiple of ``2**floor(log2 n) / steps_per_octave`` (at least ``minimum``).

    The step grows with ``n``, so padding wastes at most 1/steps_per_octave (12.5% by default) while
    the number of distinct shapes grows only logarithmically.
    """
    if n <= 0:
        return 0
    step = max(minimum, 1 << max(0, int(np.floor(np.log2(n))) - int(np.log2(steps_per_octave))))
    return int(-(-n // step) * step)


def aligned_empty(shape: tuple[int, ...], dtype, zeroed: bool = False) -> np.ndarray:
    """An array (uninitialised, or zero with ``zeroed``) whose data starts on a 64-byte boundary.

    JAX's CPU device adopts such a buffer without copying it (``jax.device_put(x, may_alias=True)``);
    numpy's own allocations are only 16-byte aligned, and then every transfer is a copy. ``zeroed``
    costs no pass of its own: large zero allocations get fresh pages the kernel zeroes on first touch.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = (np.zeros if zeroed else np.empty)(nbytes + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def pad_to(array: np.ndarray, shape: tuple[int, ...], dtype=None) -> np.ndarray:
    """Embed ``array`` in the leading corner of a zero array of ``shape`` (of ``dtype``, default the
    array's); the result is 64-byte aligned (see :func:`aligned_empty`)."""
    out = aligned_empty(shape, dtype or array.dtype, zeroed=True)
    out[tuple(slice(0, s) for s in array.shape)] = array
    return out


def pad_into(out: np.ndarray, array: np.ndarray) -> np.ndarray:
    """Write ``array`` into the leading corner of ``out`` (casting to its dtype) and zero the rest:
    one pass over ``out``, for a buffer that is allocated once and filled member by member."""
    corner = tuple(slice(0, s) for s in array.shape)
    out[corner] = array
    for axis, size in enumerate(array.shape):  # the margins, disjoint: beyond the array along `axis` only
        out[corner[:axis] + (slice(size, None),)] = 0
    return out


def stack_padded(arrays: list, dtype=None, shape: tuple[int, ...] | None = None) -> jax.Array:
    """Stack ``arrays`` (all numpy, or JAX) along a new leading axis, each zero-padded at the end of
    every axis to ``shape`` (default: the largest), as one device array (of ``dtype``, default the
    first array's).

    Host arrays are written (and cast) into one 64-byte-aligned buffer that the CPU device adopts as
    is (``may_alias``), so the stack crosses to the device without a second copy; the buffer is new
    for every call and never written again, so the alias is safe.
    """
    if shape is None:
        shape = tuple(int(s) for s in np.max([np.shape(a) for a in arrays], axis=0)) if np.ndim(arrays[0]) else ()
    if all(isinstance(a, np.ndarray) for a in arrays):
        out = aligned_empty((len(arrays),) + shape, dtype or arrays[0].dtype)
        for i, a in enumerate(arrays):
            if shape:
                pad_into(out[i], a)
            else:
                out[i] = a
        return on_device(out, may_alias=True)
    return jnp.stack([jnp.pad(jnp.asarray(a, dtype), [(0, s - d) for s, d in zip(shape, np.shape(a))]) for a in arrays])


def stack_members(members: list[dict]) -> dict[str, jax.Array]:
    """Dicts of arrays, one per batch member with the same keys, as one dict of stacks
    (:func:`stack_padded`): arrays whose sizes differ between members are zero-padded to the largest,
    which the J-K backends treat as no work (zero integrals, zero rows)."""
    if len({tuple(sorted(m)) for m in members}) != 1:
        raise ValueError("a batch needs one J-K layout (the tile plans chose different strategies)")
    return {key: stack_padded([m[key] for m in members]) for key in members[0]}


def fill_batch(items: list, size: int) -> list:
    """``items`` filled up to ``size`` with copies of the last, so that a short final batch runs the
    compiled programs of a full one (callers drop the copies' results)."""
    return list(items) + list(items[-1:]) * max(0, size - len(items))
