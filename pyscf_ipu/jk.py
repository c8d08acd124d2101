r"""J-K backends: the Coulomb and exchange contractions of the ERI with a density matrix.

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}

in einsum form ``J = einsum('ijkl,ij->kl', eri, D)`` and ``K = einsum('ijkl,jk->il', eri, D)``.

A backend is a frozen (hashable) object with two methods:

- ``prepare(eri_s8, nao, nao_padded, dtype) -> dict of arrays``: once per molecule, outside the loop.
  The arrays' shapes may depend only on padded sizes, so molecules in one bucket share compiled code.
- ``contract(data, dm) -> (J, K)``: pure JAX, traced inside the jitted SCF step.

Backends are chosen by name from :data:`JK_BACKENDS`; nothing inspects array shapes to pick one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from pyscf import ao2mo

from .padding import bucket, pad_to


class JKBackend(Protocol):
    name: str

    def prepare(self, eri_s8: np.ndarray, nao: int, nao_padded: int, dtype) -> dict[str, np.ndarray]: ...

    def contract(self, data: dict, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]: ...


@dataclass(frozen=True)
class DenseJK:
    """The reference: both contractions as matrix-vector products over (N^2, N^2) ERI matrices.

    Memory is 2 N^4 values, so this is for small molecules and for checking the others.
    """

    name: str = "dense"

    def prepare(self, eri_s8, nao, nao_padded, dtype):
        eri = ao2mo.restore(1, eri_s8, nao).astype(dtype)  # (N, N, N, N)
        return _dense_matrices(jnp.asarray(eri), nao_padded)

    def contract(self, data, dm):
        n = dm.shape[0]
        vec = dm.reshape(-1)
        return (data["eri_j"] @ vec).reshape(n, n), (data["eri_k"] @ vec).reshape(n, n)


@partial(jax.jit, static_argnums=1)
def _dense_matrices(eri, nao_padded):
    """Pad (N,)*4 -> (Np,)*4 and lay out the J and K matrices; on the device, where transposes are fast."""
    n2 = nao_padded * nao_padded
    eri = jnp.pad(eri, [(0, nao_padded - eri.shape[0])] * 4)
    return {
        "eri_j": eri.reshape(n2, n2),  # [(kl), (ij)]; symmetric
        "eri_k": eri.transpose(0, 3, 1, 2).reshape(n2, n2),  # [(il), (jk)]
    }


def unique_quartets(eri_s8: np.ndarray, nao: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero unique integrals of an s8-packed ERI: values (nnz,) and indices (nnz, 4) = i>=j, k>=l, ij>=kl."""
    t = np.flatnonzero(eri_s8)
    p, q = _tril_unpack(t)
    i, j = _tril_unpack(p)
    k, l = _tril_unpack(q)
    assert nao < 2**15, "int16 AO indices"
    return eri_s8[t], np.stack([i, j, k, l], axis=1).astype(np.int16)


def degeneracy_weights(index: np.ndarray) -> np.ndarray:
    """1/degeneracy of each unique quartet: the share of its 8 permutations that are distinct, /8.

    Summing all 8 permutations of every unique quartet, weighted so, counts each element of the full
    tensor exactly once.
    """
    i, j, k, l = (index[:, a].astype(np.int64) for a in range(4))
    p, q = i * (i + 1) // 2 + j, k * (k + 1) // 2 + l
    return 1.0 / ((1.0 + (i == j)) * (1.0 + (k == l)) * (1.0 + (p == q)))


def s8_accumulate(values, index, dm):
    """Unsymmetrised J and K partials of unique quartets (values already divided by degeneracy).

    For each quartet (ij|kl) with weight w, the 8 permutations reduce, for symmetric D, to
    ``A_J[ij] += 4w D[kl]; A_J[kl] += 4w D[ij]`` and ``A_K[il] += 2w D[jk]`` (and its three
    images). ``J = (A_J + A_J^T) / 2``, ``K = (A_K + A_K^T) / 2``: see :func:`symmetrise`.
    One gather and one scatter-add over a (2, N, N) buffer; returns that buffer.
    """
    n = dm.shape[0]
    i, j, k, l = (index[:, a].astype(jnp.int32) for a in range(4))
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


@dataclass(frozen=True)
class S8JK:
    """Unique (8-fold symmetric) screened integrals with int16 indices: gather, multiply, scatter-add.

    Stores about N^4/8 values instead of 2 N^4, padded with zero-valued quartets to a size bucket.
    """

    name: str = "s8"

    def prepare(self, eri_s8, nao, nao_padded, dtype):
        values, index = unique_quartets(eri_s8, nao)
        values = values * degeneracy_weights(index)
        size = bucket(len(values), minimum=1024)
        return {
            "values": pad_to(values, (size,)).astype(dtype),
            "index": pad_to(index, (size, 4)),
        }

    def contract(self, data, dm):
        return symmetrise(s8_accumulate(data["values"], data["index"], dm))


def _tril_unpack(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed lower-triangle index t = a(a+1)/2 + b (b <= a) -> (a, b), exactly in integers."""
    t = t.astype(np.int64)
    a = ((np.sqrt(8.0 * t + 1.0) - 1.0) / 2.0).astype(np.int64)
    a -= a * (a + 1) // 2 > t  # float rounding: fix up by one either way
    a += (a + 1) * (a + 2) // 2 <= t
    return a, t - a * (a + 1) // 2


JK_BACKENDS: dict[str, JKBackend] = {"dense": DenseJK(), "s8": S8JK()}


def get_jk_backend(name: str) -> JKBackend:
    """The J-K backend registered under ``name``."""
    try:
        return JK_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown J-K backend {name!r}: choose one of {', '.join(JK_BACKENDS)}") from None
