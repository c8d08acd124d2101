"""Shared shapes: round sizes up to a few buckets so that compiled code is reused across molecules.

A jitted function compiles once per input shape. Rounding the number of AOs, grid points and stored
integrals up to buckets makes many molecules share one compiled SCF loop; the padded entries carry
zero weight (grid), zero integrals (ERI) or are kept as empty virtual orbitals (AOs).
"""

from __future__ import annotations

import numpy as np


def bucket(n: int, minimum: int = 8, steps_per_octave: int = 8) -> int:
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
