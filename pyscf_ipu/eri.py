r"""The electron-repulsion integrals in the forms the J-K contractions use, and their kernels.

PySCF hands over the ERI in its s8 packing: the lower triangle of the symmetric (npair, npair)
matrix of pairs p = ij (i >= j), npair = N(N+1)/2. From it we derive

- **unique quartets**: the non-zero (ij|kl) with i>=j, k>=l, ij>=kl, their AO indices as int16 and
  the 1/degeneracy weights that let every quartet be expanded over all 8 permutations;
- **the row matrix**: J's and K's (npair, npair) matrices stacked, whose product with the density
  on the pairs gives J and K on the pairs directly (the symmetry-reduced "rows" form, N^4/2 values).

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from pyscf import ao2mo

MAX_NAO = 2**15 - 1  # AO indices are stored as int16


def tril_unpack(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed lower-triangle index t = a(a+1)/2 + b (b <= a) -> (a, b), exactly, in int64."""
    t = np.asarray(t, np.int64)
    a = ((np.sqrt(8.0 * t + 1.0) - 1.0) / 2.0).astype(np.int64)
    a -= a * (a + 1) // 2 > t  # float rounding: fix up by one either way
    a += (a + 1) * (a + 2) // 2 <= t
    return a, t - a * (a + 1) // 2


def pair_index(nao: int, nao_padded: int | None = None) -> np.ndarray:
    """(Np, Np) int32: the pair number of (i, j), i.e. of (max, min); padded AOs point at npair."""
    npad = nao_padded or nao
    i, j = np.meshgrid(np.arange(npad), np.arange(npad), indexing="ij")
    hi, lo = np.maximum(i, j), np.minimum(i, j)
    index = hi * (hi + 1) // 2 + lo
    index[(i >= nao) | (j >= nao)] = nao * (nao + 1) // 2
    return index.astype(np.int32)


def unique_quartets(eri_s8: np.ndarray, nao: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero unique integrals: values (nnz,) and AO indices (nnz, 4) int16, i>=j, k>=l, ij>=kl."""
    if nao > MAX_NAO:
        raise ValueError(f"{nao} AOs: unique-quartet storage uses int16 indices, at most {MAX_NAO} AOs")
    t = np.flatnonzero(eri_s8)
    p, q = tril_unpack(t)
    i, j = tril_unpack(p)
    k, l = tril_unpack(q)
    return eri_s8[t], np.stack([i, j, k, l], axis=1).astype(np.int16)


def degeneracy_weights(index: np.ndarray) -> np.ndarray:
    """1/degeneracy of each unique quartet: the share of its 8 permutations that are distinct, /8.

    Summing all 8 permutations of every unique quartet, weighted so, counts each element of the full
    tensor exactly once.
    """
    i, j, k, l = (index[:, a].astype(np.int64) for a in range(4))
    p, q = i * (i + 1) // 2 + j, k * (k + 1) // 2 + l
    return 1.0 / ((1.0 + (i == j)) * (1.0 + (k == l)) * (1.0 + (p == q)))


def row_matrix(eri_s8: np.ndarray, nao: int, dtype=np.float32) -> np.ndarray:
    """The symmetry-reduced J and K matrices stacked, (2 npair, npair): ``[MJ diag(w); MK]``.

    With D_pairs[ij] = D[i, j] over pairs i >= j, ``row_matrix @ D_pairs`` gives J on the pairs
    (first npair entries) and K on the pairs (last npair):

    - MJ[kl, ij] = (ij|kl) (PySCF's s4 form) and w = 2 off the diagonal (D_ij and D_ji), 1 on it;
    - MK[il, jk] = (ij|kl) + (ik|jl) for j > k, (ij|jl) for j = k (K_il over both orderings of j
      and k, D being symmetric).

    MK is built one AO i at a time from the slab (ij|kl) = s4[pair(i, j), pair(k, l)], which gives
    its rows (i, l), l <= i, at once; peak memory is the output plus PySCF's float64 s4 matrix.
    """
    npair = nao * (nao + 1) // 2
    s4 = ao2mo.restore(4, eri_s8, nao)  # (npair, npair) float64
    out = np.empty((2 * npair, npair), dtype)
    a, b = tril_unpack(np.arange(npair))  # pair p = (a, b), a >= b
    w = np.where(a == b, 1.0, 2.0)
    pair = pair_index(nao)
    diag = np.arange(nao)
    for i in range(nao):
        rows = slice(i * (i + 1) // 2, (i + 1) * (i + 2) // 2)  # pairs (i, l), l <= i
        out[rows] = s4[rows] * w
        slab = s4[pair[i]][:, pair[:, : i + 1]]  # (j, k, l) = (ij|kl), l <= i
        t = slab.transpose(2, 0, 1)  # (l, j, k)
        fold = t + t.transpose(0, 2, 1)  # (ij|kl) + (ik|jl)
        fold[:, diag, diag] = t[:, diag, diag]  # j = k: once
        out[npair + rows.start : npair + rows.stop] = fold[:, a, b]
    return out


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
