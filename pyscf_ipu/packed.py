r"""The electron-repulsion integrals in the forms the J-K contractions use, and their kernels.

PySCF hands over the ERI in its s8 packing: the lower triangle of the symmetric (npair, npair)
matrix of pairs p = ij (i >= j), npair = N(N+1)/2. From it we derive

- **unique quartets**: the non-zero (ij|kl) with i>=j, k>=l, ij>=kl, their AO indices as int16 and
  the 1/degeneracy weights that let every quartet be expanded over all 8 permutations;
- **the row matrix**: J's and K's (npair, npair) matrices stacked, whose product with the density
  on the pairs gives J and K on the pairs directly (the symmetry-reduced "rows" form, N^4/2 values),
  gathered on the device by :func:`row_matrix` from the 4-fold form that :func:`s8_to_s4` unpacks.

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from .padding import stack_padded

MAX_NAO = 2**15 - 1  # AO indices are stored as int16
ROW_BLOCK_VALUES = 2**24  # working-set size (values) of one step of row_matrix


def triangle_side(length: int) -> int:
    """N of a packed triangle of ``length`` = N(N+1)/2 entries: the AOs of ``npair`` pairs, say."""
    return int(round((np.sqrt(8.0 * length + 1.0) - 1.0) / 2.0))


def s8_aos(length: int) -> int:
    """The AO count N of an s8 array of ``length`` = P(P+1)/2 entries, P = N(N+1)/2."""
    return triangle_side(triangle_side(length))


def s8_size(nao: int) -> int:
    """Entries of the s8 array of ``nao`` AOs: P(P+1)/2, P = N(N+1)/2."""
    npair = nao * (nao + 1) // 2
    return npair * (npair + 1) // 2


@dataclass(frozen=True, eq=False)
class PackedERI:
    """One conformer's ERIs as the J-K backends take them: PySCF's s8 packing of ``nao`` AOs and the
    count of its non-zero entries (which the planners size their work by)."""

    s8: np.ndarray  # (s8_size(nao),)
    nao: int
    kept: int

    @classmethod
    def of(cls, s8: np.ndarray) -> PackedERI:
        """The record of ``s8``, its AO count and non-zero entries found from it."""
        return cls(s8, s8_aos(len(s8)), int(np.count_nonzero(s8)))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FittedFactor:
    """A batch's density-fitted ERIs as the fitted J-K backend takes them: the Cholesky factor B
    with (ij|kl) ~ sum_Q B[Q, ij] B[Q, kl], over the pairs i >= j of the padded AOs (padded AOs' and
    padded fitting functions' entries zero), in the loop's precision and in float64 (which the
    finalisation's J reads), and the bucket's bound on a density's rank (static)."""

    packed: jax.Array  # (C, Qp, npair)  in the loop's precision
    exact: jax.Array  # (C, Qp, npair)  float64
    rank: int = field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StreamedFactor:
    """A batch's density-fitted factor held once, in float64, in the rectangular layout
    (:func:`rectangular_columns`) that the fitted backend reads a block of fitting functions at a
    time: what a bucket that streams its factor (:attr:`~pyscf_ipu.buckets.SizeBucket.streams_factor`)
    holds instead of a :class:`FittedFactor`."""

    exact: jax.Array  # (C, Qp, npair)  float64, the pairs in rectangular order
    rank: int = field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RangeSeparatedERIs:
    """A range-separated hybrid's two-electron integrals: those of the Coulomb operator 1/r and of its
    long-range part erf(ω r)/r, each in the form the J-K backend takes (s8 arrays or a
    :class:`FittedFactor`); what the backend lays out from them, likewise."""

    coulomb: object
    long_range: object


def batch_eris(eris: list[np.ndarray], nao_padded: int, dtype) -> jax.Array:
    """Host s8 arrays, each of at most ``nao_padded`` AOs (its own first: the s8 packing of fewer AOs
    is the leading part of the padded AOs'), as what :meth:`JKBackend.prepare` takes: one device
    array (C, s8 size of ``nao_padded``) in ``dtype``."""
    return stack_padded([np.asarray(eri) for eri in eris], dtype, (s8_size(nao_padded),))


def tril_unpack(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed lower-triangle index t = a(a+1)/2 + b (b <= a) -> (a, b), exactly, in int64."""
    t = np.asarray(t, np.int64)
    a = ((np.sqrt(8.0 * t + 1.0) - 1.0) / 2.0).astype(np.int64)
    a -= a * (a + 1) // 2 > t  # float rounding: fix up by one either way
    a += (a + 1) * (a + 2) // 2 <= t
    return a, t - a * (a + 1) // 2


def traced_tril_unpack(t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`tril_unpack` of a JAX integer array, in its integer type (inside a program)."""
    a = jnp.floor((jnp.sqrt(8.0 * t.astype(jnp.float64) + 1.0) - 1.0) / 2.0).astype(t.dtype)
    a = a - (a * (a + 1) // 2 > t)
    a = a + ((a + 1) * (a + 2) // 2 <= t)
    return a, t - a * (a + 1) // 2


def pair_index(nao: int, nao_padded: int | None = None) -> np.ndarray:
    """(Np, Np) int32: the pair number of (i, j), i.e. of (max, min); padded AOs point at npair."""
    npad = nao_padded or nao
    i, j = np.meshgrid(np.arange(npad), np.arange(npad), indexing="ij")
    hi, lo = np.maximum(i, j), np.minimum(i, j)
    index = hi * (hi + 1) // 2 + lo
    index[(i >= nao) | (j >= nao)] = nao * (nao + 1) // 2
    return index.astype(np.int32)


def _rectangular_shape(n: int) -> tuple[int, int, int, int]:
    """(h, k, row offset, column offset) of the rectangular layout of ``n`` AOs: h = ceil(n / 2)."""
    h = (n + 1) // 2
    return h, n - h, 1 - n % 2, n % 2


@lru_cache(maxsize=8)
def rectangular_columns(n: int) -> np.ndarray:
    """(n, n) int32: each AO pair's column in the rectangular layout of a packed symmetric matrix.

    The N(N+1)/2 pairs fill an (N + 1 - N mod 2, h) array, h = ceil(N / 2), row-major (after LAPACK's
    rectangular full packed format; Gustavson, Wasniewski, Dongarra and Langou 2010): the first h
    columns of the lower triangle L stand in its rows from the row offset on (L[r, s] at [r + 1 - N mod 2, s]),
    and the lower triangle of the trailing k x k block (k = N - h) stands transposed in the triangle
    they leave free (L[h + a, h + b], a >= b, at [b, a + N mod 2]). Unlike the row-packed order, a
    block of these rows multiplies a matrix with slices, transposes and products alone
    (:func:`rectangular_times`), no gather.
    """
    h, _, row_offset, column_offset = _rectangular_shape(n)
    r, s = np.tril_indices(n)
    column = np.where(s < h, (r + row_offset) * h + s, (s - h) * h + (r - h) + column_offset)
    out = np.empty((n, n), np.int32)
    out[r, s], out[s, r] = column, column
    return out


def rectangular_order(n: int) -> np.ndarray:
    """(npair,) int32: the row-packed pair number of each column of the rectangular layout of ``n`` AOs."""
    order = np.empty(n * (n + 1) // 2, np.int32)
    r, s = np.tril_indices(n)
    order[rectangular_columns(n)[r, s]] = r * (r + 1) // 2 + s
    return order


@lru_cache(maxsize=8)
def _rectangular_segments(n: int) -> tuple[tuple[int, int, int, int], ...]:
    """(source, destination, length, stride) of the copies that move row-packed pairs of ``n`` AOs to
    their rectangular columns: each row of L's first h columns, then each row of its trailing block."""
    h, k, row_offset, column_offset = _rectangular_shape(n)
    rows = [(r * (r + 1) // 2, (r + row_offset) * h, min(r + 1, h), 1) for r in range(n)]
    trailing = [((h + a) * (h + a + 1) // 2 + h, a + column_offset, a + 1, h) for a in range(k)]
    return tuple(rows + trailing)


def to_rectangular(factor: np.ndarray, block: int = 64) -> None:
    """Reorder the columns of ``factor`` (rows, npair), row-packed pairs, into the rectangular layout
    (:func:`rectangular_columns`), in place: a copy of ``block`` rows at a time is all it holds beside."""
    segments = _rectangular_segments(triangle_side(factor.shape[1]))
    for start in range(0, len(factor), block):
        rows = factor[start : start + block]
        packed = rows.copy()
        for source, destination, length, stride in segments:
            end = destination + (length - 1) * stride + 1
            rows[:, destination:end:stride] = packed[:, source : source + length]


def rectangular_times(block: jax.Array, w: jax.Array) -> jax.Array:
    """(c, n, R): S_q W for each row q of ``block`` (c, npair), a symmetric (n, n) S_q in the rectangular
    layout of n AOs, and ``w`` (n, R).

    With S = [[S11, S21^T], [S21, S22]] split at h, only the two symmetric diagonal blocks are unpacked
    (their triangles mirrored); S21 enters its products as stored, S21^T W2 as a contraction over its rows."""
    n = w.shape[0]
    h, k, row_offset, column_offset = _rectangular_shape(n)
    c = block.shape[0]
    a = block.reshape(c, n + row_offset, h)
    first = a[:, row_offset:]  # (c, n, h)  L[:, :h] below the diagonal
    top = first[:, :h]
    s11 = jnp.where(np.tri(h, dtype=bool), top, jnp.swapaxes(top, 1, 2))  # (c, h, h)
    s21 = first[:, h:]  # (c, k, h)
    trailing = a[:, :k, column_offset : column_offset + k]  # L[h + a, h + b] at [b, a] for a >= b
    s22 = jnp.where(np.tri(k, dtype=bool), jnp.swapaxes(trailing, 1, 2), trailing)  # (c, k, k)
    w1, w2, r = w[:h], w[h:], w.shape[1]
    upper = (s11.reshape(c * h, h) @ w1).reshape(c, h, r) + jnp.einsum("qkh,kr->qhr", s21, w2)
    lower = (s21.reshape(c * k, h) @ w1).reshape(c, k, r) + (s22.reshape(c * k, k) @ w2).reshape(c, k, r)
    return jnp.concatenate([upper, lower], 1)


def unique_quartets(eri_s8: np.ndarray, nao: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero unique integrals: values (nnz,) and AO indices (nnz, 4) int16, i>=j, k>=l, ij>=kl."""
    if nao > MAX_NAO:
        raise ValueError(f"{nao} AOs: unique-quartet storage uses int16 indices, at most {MAX_NAO} AOs")
    t = np.flatnonzero(eri_s8)
    p, q = tril_unpack(t)
    i, j = tril_unpack(p)
    k, l = tril_unpack(q)
    return eri_s8[t], np.stack([i, j, k, l], axis=1).astype(np.int16)


# Bytes per unique integral while unique_quartets and degeneracy_weights sort them out on the host
# (int64 flat and pair indices, four int64 AO indices and their stack, float64 values), before the
# (value, four int16 indices) records that stay.
QUARTET_SORTING_BYTES = 96


def quartet_bytes(nao_padded: int, value_bytes: int) -> int:
    """Peak bytes of the unique-quartet records of ``nao_padded`` AOs (the ``s8`` layouts): their
    sorting, then the records padded up to a bucket of at most twice their count."""
    return s8_size(nao_padded) * (QUARTET_SORTING_BYTES + 2 * (value_bytes + 8))


def degeneracy_weights(index: np.ndarray) -> np.ndarray:
    """1/degeneracy of each unique quartet: the share of its 8 permutations that are distinct, /8.

    Summing all 8 permutations of every unique quartet, weighted so, counts each element of the full
    tensor exactly once.
    """
    i, j, k, l = (index[:, a].astype(np.int64) for a in range(4))
    p, q = i * (i + 1) // 2 + j, k * (k + 1) // 2 + l
    return 1.0 / ((1.0 + (i == j)) * (1.0 + (k == l)) * (1.0 + (p == q)))


def s8_to_s4(s8: jnp.ndarray, npair: int) -> jnp.ndarray:
    """PySCF's s8 packing (npair(npair+1)/2,) -> its 4-fold (npair, npair) matrix, on the device.

    Element (p, q) is s8[max(p, q)(max(p, q) + 1)/2 + min(p, q)]; the index is built from iotas, so
    nothing of size npair^2 is transferred or baked into the compiled code (the host would unpack
    and send twice as many bytes).
    """
    p = jnp.arange(npair, dtype=jnp.int32)[:, None]
    q = jnp.arange(npair, dtype=jnp.int32)[None, :]
    hi, lo = jnp.maximum(p, q), jnp.minimum(p, q)
    return s8[hi * (hi + 1) // 2 + lo]  # int32: npair(npair+1)/2 < 2^31 up to npair ~ 65k (N ~ 360)


def row_matrix(s4: jnp.ndarray, nao: int, nao_padded: int) -> jnp.ndarray:
    """The symmetry-reduced J and K matrices stacked, ``[MJ diag(w); MK]``, built on the device.

    The matrix is (2 npair_pad, npair_pad) for ``nao_padded`` AOs; ``row_matrix @ D_pairs`` with
    D_pairs[ij] = D[i, j] over pairs i >= j gives J on the pairs (first npair_pad entries) and K on
    the pairs (the rest):

    - MJ[kl, ij] = (ij|kl) (PySCF's s4 form) and w = 2 off the diagonal (D_ij and D_ji), 1 on it;
    - MK[il, jk] = (ij|kl) + (ik|jl) for j > k, (ij|jl) for j = k (K_il over both orderings of j
      and k, D being symmetric).

    ``s4`` is the 4-fold (npair, npair) form of the ``nao`` real AOs (:func:`s8_to_s4`), with
    (ij|kl) = s4[pair(i, j), pair(k, l)]. Pairs of padded AOs (numbered after the real ones) are
    zero. MJ is s4 scaled by columns; MK is gathered by whole rows and columns (``take``), which XLA
    does far faster than element-wise gathers, and no index exceeds N^2, so int32 never overflows.
    """
    n = nao
    npair, npair_pad = n * (n + 1) // 2, nao_padded * (nao_padded + 1) // 2
    a, b = tril_unpack(np.arange(npair))  # pair p = (a, b), a >= b: numpy, fixed at trace time
    pairs = jnp.asarray(pair_index(n))  # (N, N)
    fold_columns = (a * n + b).astype(np.int32)  # (j, k), j >= k, of each column, in the (N * N) fold
    on_diagonal = np.eye(n, dtype=bool)

    def mk_rows(i):
        """MK's rows (i, l) for every l, (N, npair); those with l > i are dropped below."""
        slab = jnp.take(jnp.take(s4, pairs[i], axis=0), pairs.reshape(-1), axis=1)  # (j, kl) = (ij|kl)
        t = slab.reshape(n, n, n).transpose(2, 0, 1)  # (l, j, k)
        fold = jnp.where(on_diagonal, t, t + t.transpose(0, 2, 1))  # (ij|kl) + (ik|jl); j = k once
        return jnp.take(fold.reshape(n, n * n), fold_columns, axis=1)

    # AOs i in batches of about 2^24 slab values: small molecules in one step, while a large one
    # peaks at N^2 npair values (the output's size) instead of the full tensor's N^4.
    batch = max(1, min(n, ROW_BLOCK_VALUES // n**3))
    mk = jax.lax.map(mk_rows, jnp.arange(n), batch_size=batch).reshape(n * n, npair)  # row i * N + l
    mk = jnp.take(mk, fold_columns, axis=0)  # rows (i, l), l <= i, in pair order
    mj = s4 * jnp.asarray(np.where(a == b, 1.0, 2.0), s4.dtype)  # MJ[kl, ij] w[ij]
    pad = [(0, npair_pad - npair), (0, npair_pad - npair)]
    return jnp.concatenate([jnp.pad(mj, pad), jnp.pad(mk, pad)])  # (2 npair_pad, npair_pad)


HOST_BLOCK = 256  # rows of the 4-fold form mirrored at once by host_row_matrix


def host_row_matrix(s8: np.ndarray, nao: int, out: np.ndarray) -> np.ndarray:
    """:func:`row_matrix` built on the host into ``out`` (2 npair_pad, npair_pad), in its dtype, from
    the s8 array of ``nao`` real AOs (any float dtype, rounded as it is copied); the same values, bit
    for bit, without XLA's element-by-element gathers (``docs/decisions/rows-layout.md``): the 4-fold
    form is copied row by row from the packed triangle and mirrored block by block, and MK's rows for
    one AO i are two flat gathers from the 4-fold rows of the pairs (i, j), by index tables that depend
    on the AO count only."""
    n = nao
    npair, npair_pad = n * (n + 1) // 2, out.shape[1]
    mj, mk = out[:npair_pad], out[npair_pad:]
    s4 = mj[:npair, :npair]
    start = 0
    for p in range(npair):  # row p's lower part is the packed triangle's row p
        s4[p, : p + 1] = s8[start : start + p + 1]
        start += p + 1
    for r0 in range(0, npair, HOST_BLOCK):  # the upper part, mirrored a block of rows at a time
        r1 = min(npair, r0 + HOST_BLOCK)
        s4[r0:r1, r1:] = s4[r1:, r0:r1].T
        block = s4[r0:r1, r0:r1]
        upper = np.triu_indices(r1 - r0, 1)
        block[upper] = block.T[upper]
    pairs, first, second = _host_row_tables(n)
    rows = np.zeros(n * npair + 1, out.dtype)  # the 4-fold rows of the pairs (i, j), then a zero
    other = np.empty((n, npair), out.dtype)
    row = 0
    for i in range(n):  # MK's rows (i, l), l <= i: (ij|kl) + (ik|jl) at column (j, k)
        np.take(s4, pairs[i], axis=0, out=rows[:-1].reshape(n, npair))
        # the indices are in range by construction: "wrap" skips numpy's bounds checks
        np.take(rows, first[: i + 1], out=mk[row : row + i + 1, :npair], mode="wrap")
        np.take(rows, second[: i + 1], out=other[: i + 1], mode="wrap")
        mk[row : row + i + 1, :npair] += other[: i + 1]
        row += i + 1
    a, b = tril_unpack(np.arange(npair))
    s4 *= np.where(a == b, 1.0, 2.0).astype(out.dtype)  # MJ[kl, ij] w[ij], once MK has read the 4-fold form
    mj[:npair, npair:] = 0.0
    mj[npair:] = 0.0
    mk[:npair, npair:] = 0.0
    mk[npair:] = 0.0
    return out


@lru_cache(maxsize=2)
def _host_row_tables(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`host_row_matrix`'s tables for ``n`` AOs: the pair numbers (N, N), and for each l and each
    column (j, k), j >= k, the flat positions of (ij|kl) and of (ik|jl) among the rows of the pairs
    (i, j) (N, npair) each; (ik|jl) of j = k points at the zero past them (it is counted once)."""
    npair = n * (n + 1) // 2
    pairs = pair_index(n)
    j, k = tril_unpack(np.arange(npair))
    l = np.arange(n)[:, None]
    first = j * npair + pairs[k[None, :], l]
    second = k * npair + pairs[j[None, :], l]
    second[:, j == k] = n * npair
    return pairs, first.astype(np.intp), second.astype(np.intp)


def unpack_pairs(values: jnp.ndarray, pairs: jnp.ndarray) -> jnp.ndarray:
    """(npair,) pair values -> the symmetric (Np, Np) matrix, zero on padded AOs (``pairs`` from pair_index)."""
    return jnp.concatenate([values, jnp.zeros(1, values.dtype)])[pairs]


def s8_accumulate(values, index, dm):
    """Unsymmetrised J and K partials of unique quartets (values already divided by degeneracy).

    For each quartet (ij|kl) with weight w, the 8 permutations reduce, for symmetric D, to
    ``A_J[ij] += 4w D[kl]; A_J[kl] += 4w D[ij]`` and ``A_K[il] += 2w D[jk]`` (and its three
    images). ``J = (A_J + A_J^T) / 2``, ``K = (A_K + A_K^T) / 2``: see :func:`symmetrise`.
    One gather and one scatter-add over a (2, N, N) buffer; returns that buffer.
    """
    n = dm.shape[0]
    i, j, k, l = (index[..., a].astype(jnp.int32) for a in range(4))
    flat = dm.reshape(-1)
    w2 = 2 * values
    src = jnp.concatenate([k * n + l, i * n + j, j * n + k, i * n + k, j * n + l, i * n + l])
    nn = n * n  # K partials live in the second half of the buffer
    dst = jnp.concatenate([i * n + j, k * n + l, i * n + l + nn, j * n + l + nn, i * n + k + nn, j * n + k + nn])
    coef = jnp.concatenate([2 * w2, 2 * w2, w2, w2, w2, w2])
    acc = jnp.zeros(2 * n * n, dm.dtype).at[dst].add(coef * flat[src])
    return acc.reshape(2, n, n)


def symmetrise(partials):
    """(2, N, N) partial sums -> (J, K), each (A + A^T) / 2."""
    sym = 0.5 * (partials + jnp.swapaxes(partials, -1, -2))
    return sym[0], sym[1]
