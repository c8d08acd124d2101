r"""J-K backends: the Coulomb and exchange contractions of the ERI with a density matrix.

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}

in einsum form ``J = einsum('ijkl,ij->kl', eri, D)`` and ``K = einsum('ijkl,jk->il', eri, D)``.

A backend is a frozen (hashable) object:

- ``prepare(eris, nao_padded, dtype) -> arrays``: once per batch of conformers, outside the loop,
  their arrays stacked along a leading axis, from the batch's integrals on the device (C, s8 size of
  ``nao_padded`` AOs) in ``dtype``, padded AOs' integrals zero; a density-fitted backend takes a
  :class:`FittedFactor` instead. The arrays' shapes may depend only on padded sizes, so molecules in
  one bucket share compiled code.
- ``contract(data, dm) -> (J, K)``: one conformer's, pure JAX, traced inside the SCF loop (which
  the loop's program vmaps over the batch).
- ``profile(eri, nao_padded, dtype, iterations) -> dict | None``: how the work of one conformer
  (its ``PackedERI``) is spread, computed only when asked for.
- ``layout_bytes(bucket, value_bytes) -> int``: the host and device memory that ``prepare``
  takes for one conformer of ``bucket`` at its peak, its temporaries included (for
  :mod:`pyscf_ipu.memory`);
- ``resident_bytes(bucket, value_bytes) -> int``: what its arrays hold once prepared, which a batch
  prepared ahead holds while another runs.

Backends are registered by name in :data:`JK_BACKENDS` (each entry builds the backend from the run's
:class:`RKSConfig`; :func:`pyscf_ipu.method.resolve` picks one); nothing inspects array shapes to
pick one. ``ipu`` (the default) is the tile-partitioned contraction on a simulated IPU (:mod:`pyscf_ipu.ipu`); ``dense`` is the reference;
``df`` contracts density-fitted integrals (no N^4 array at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .buckets import SizeBucket
from .config import RKSConfig
from .packed import (FittedFactor, PackedERI, batch_eris, degeneracy_weights, pair_index, quartet_bytes, s8_accumulate,
                     s8_to_s4, symmetrise, unique_quartets)
from .ipu import IPUJK, ipu_model
from .padding import padded_size, pad_to, stack_members
from .programs import compiled, full_precision, on_device, precision_scope


class JKBackend(Protocol):
    name: str

    def prepare(self, eris, nao_padded: int, dtype): ...

    def contract(self, data: dict, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]: ...

    def profile(self, eri: PackedERI, nao_padded: int, dtype, iterations: int) -> dict | None:
        """A report of how the backend spreads the work (None if it has nothing to say)."""

    def layout_bytes(self, bucket: SizeBucket, value_bytes: int) -> int:
        """Peak bytes of ``prepare`` for one conformer of ``bucket`` (unscreened ERIs)."""

    def resident_bytes(self, bucket: SizeBucket, value_bytes: int) -> int:
        """Bytes of ``prepare``'s arrays for one conformer of ``bucket``, its temporaries gone."""



@dataclass(frozen=True)
class DenseJK:
    """The reference: both contractions as matrix-vector products over (N^2, N^2) ERI matrices.

    Memory is 2 N^4 values, so this is for small molecules and for checking the others.
    """

    name: str = "dense"

    def prepare(self, eris, nao_padded, dtype):
        return _dense_matrices(eris, nao_padded)

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        # the s4 unpacking, the (N,)*4 tensor and its two layouts
        return bucket.nao**4 * 4 * value_bytes

    def resident_bytes(self, bucket, value_bytes):
        return bucket.nao**4 * 2 * value_bytes

    def contract(self, data, dm):
        n = dm.shape[0]
        vec = dm.reshape(-1)
        return (data["eri_j"] @ vec).reshape(n, n), (data["eri_k"] @ vec).reshape(n, n)


def s8_coulomb_exchange(s8: jax.Array, dm: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""J and K of the density ``dm`` (N, N) from PySCF's s8-packed ERIs ``s8``, in ``dm``'s precision,
    one AO row at a time: with the block :math:`E^{(i)}_{jkl} = (ij|kl)` unpacked from the 4-fold
    matrix, :math:`J_{ij} = \sum_{kl} E^{(i)}_{jkl} D_{kl}` and :math:`K_{il} = \sum_{jk} E^{(i)}_{jkl} D_{jk}`.
    No N^4 array is formed (each step holds N^3), which suits a single pass such as the finalisation."""
    n = dm.shape[0]
    s4 = s8_to_s4(s8, n * (n + 1) // 2)  # (npair, npair)
    pairs = jnp.asarray(pair_index(n))  # (N, N)

    def row(index):  # (N,) the pairs (i, j) of one i
        block = s4[index][:, pairs.reshape(-1)].reshape(n, n, n).astype(dm.dtype)  # [j, k, l] = (ij|kl)
        return jnp.einsum("jkl,kl->j", block, dm), jnp.einsum("jkl,jk->l", block, dm)

    return jax.lax.map(row, pairs)


@partial(compiled, static_argnums=1, name="dense_layout")
def _dense_matrices(eris, nao_padded):
    """Each conformer's s8 ERIs (C, size) as the J and K matrices (C, Np^2, Np^2), on the device."""
    npair = nao_padded * (nao_padded + 1) // 2
    pairs = jnp.asarray(pair_index(nao_padded)).reshape(-1)

    def member(s8):
        full = s8_to_s4(s8, npair)[pairs][:, pairs]  # [(ij), (kl)]: (ij|kl); symmetric
        eri = full.reshape((nao_padded,) * 4)
        return {"eri_j": full, "eri_k": eri.transpose(0, 3, 1, 2).reshape(full.shape)}  # [(il), (jk)]

    return jax.vmap(member)(eris)


@dataclass(frozen=True)
class S8JK:
    """Unique (8-fold symmetric) screened integrals with int16 indices: gather, multiply, scatter-add.

    Stores about N^4/8 values instead of 2 N^4, padded with zero-valued quartets to a size bucket.
    """

    name: str = "s8"

    def prepare(self, eris, nao_padded, dtype):
        # the unique integrals are sorted out on the host (a scatter's index list)
        quartets = [unique_quartets(s8, nao_padded) for s8 in np.asarray(eris)]
        size = padded_size(max(len(values) for values, _ in quartets), minimum=1024)  # one shape for the batch
        return stack_members([{"values": pad_to(values * degeneracy_weights(index), (size,), dtype),
                               "index": pad_to(index, (size, 4))} for values, index in quartets])  # fmt: skip

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        return quartet_bytes(bucket.nao, value_bytes)

    def resident_bytes(self, bucket, value_bytes):
        return quartet_bytes(bucket.nao, value_bytes)

    def contract(self, data, dm):
        return symmetrise(s8_accumulate(data["values"], data["index"], dm))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FittedArrays:
    """A conformer's fitted J-K arrays: the unpacked factor, and the bucket's rank bound R (static)."""

    factor: jax.Array  # (Np, Qp, Np)  B_Q[i, j] at [i, Q, j]; zero for padded AOs and fitting functions
    packed: jax.Array  # (Qp, npair)  B over the pairs i >= j of the padded AOs
    exact: jax.Array  # (Qp, npair)  the same in float64: the finalisation's J reads it, the loop does not
    pairs: jax.Array  # (Np, Np) int32  each AO pair's column in ``packed``
    rank: int = field(metadata=dict(static=True))


@dataclass(frozen=True)
class FittedJK:
    r"""Density fitting (resolution of the identity): with the Cholesky factor of the fitted ERIs,
    :math:`(ij|kl) \approx \sum_Q B_{Q,ij} B_{Q,kl}`,

    .. math::

        J = \sum_Q B_Q\, \mathrm{tr}(B_Q D), \qquad K = \sum_Q B_Q D B_Q
          = \sum_Q (B_Q U w^{1/2}) (B_Q U w^{1/2})^T

    where :math:`D = U \mathrm{diag}(w) U^T` over its R largest eigenvalues, R the bucket's bound on
    the occupied orbitals (:attr:`~pyscf_ipu.buckets.SizeBucket.occupied_rank`): the densities the
    loop forms from orbitals have rank at most R, so K costs 4 Q N^2 R operations instead of
    4 Q N^3. Only the initial guess (a superposition of atomic densities) has a higher rank (about
    five per heavy atom); its K keeps the R largest weights. That Fock matrix only starts the loop
    (DIIS leaves it out), so the converged result does not depend on it. J is exact for any density,
    from the packed factor. B is held unpacked, Q ~ 6 N values per AO pair instead of the N^2 / 2 of the s8 ERIs. The labels
    differ from exact ERIs by the fitting error (Whitten 1973; Vahtras, Almlof and Feyereisen 1993).
    """

    name: str = "df"

    def prepare(self, eris: FittedFactor, nao_padded, dtype):
        return FittedArrays(_unpacked_factors(eris.packed, nao_padded), eris.packed, eris.exact,
                            _pairs(nao_padded, len(eris.packed)), eris.rank)  # fmt: skip

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        # the unpacked factors and the loop's (Np, Qp, R) products (B_Q U w^(1/2), the products'
        # temporaries and their batched forms); the packed factors are the integral source's
        return bucket.naux * (bucket.nao**2 + 4 * bucket.nao * bucket.occupied_rank) * value_bytes

    def resident_bytes(self, bucket, value_bytes):
        return bucket.naux * bucket.nao**2 * value_bytes

    def contract(self, data: FittedArrays, dm):
        y = exchange_factor(data.factor, density_factor(dm, data.rank))  # (R Qp, Np)
        return fitted_coulomb(data.packed, data.pairs, dm), y.T @ y


def fitted_coulomb(packed, pairs, dm):
    """J (Np, Np) of the density ``dm`` from a packed factor (Qp, npair), exactly whatever the density's
    rank: rho_Q = tr(B_Q D) over the packed pairs (the scatter adds D_ij and D_ji into pair ij), then
    J = sum_Q rho_Q B_Q; in the factor's and the density's common precision."""
    rho = packed @ jnp.zeros(packed.shape[1], dm.dtype).at[pairs].add(dm)  # (Qp,)
    return (rho @ packed)[pairs]  # a reduction over Q of the (i, Q, j) layout is slow batched


def density_factor(dm, rank: int):
    """(Np, R): U diag(w)^(1/2) over the ``rank`` largest eigenpairs of the density ``dm`` (Np, Np),
    so that D = W W^T for densities of at most that rank."""
    n = dm.shape[0]
    w, u = jnp.linalg.eigh(dm)  # ascending: a density is positive semidefinite, its weight at the end
    return u[:, n - rank :] * jnp.sqrt(jnp.maximum(w[n - rank :], 0.0))


def exchange_factor(bt, w):
    """(R Qp, Np): Y with K = Y^T Y, from the factor ``bt`` (Np, Qp, Np) and ``w`` (Np, R) of the density.

    (B_Q W)^T at [r, (Q, i)] from the (N, Q N) view: B_Q is symmetric, so row j of that view holds
    B_Q[i, j] over (Q, i); read as (R Q, N), K is one product Y^T Y."""
    n, q = bt.shape[0], bt.shape[1]
    return (w.T @ bt.reshape(n, q * n)).reshape(w.shape[1] * q, n)


@partial(compiled, static_argnums=1, name="fitted_factors")
def _unpacked_factors(packed, nao_padded: int):
    """(C, Np, Qp, Np): each conformer's packed factor (Qp, npair) gathered onto its AO pairs, laid
    out so that B_Q U for all Q is one matrix product whose result K needs no transpose of."""
    index = jnp.asarray(pair_index(nao_padded))
    return jax.vmap(lambda factor: jnp.transpose(factor[:, index], (1, 0, 2)))(packed)


@lru_cache(maxsize=8)
def _pairs(nao_padded: int, batch: int) -> jax.Array:
    """(C, Np, Np) int32: each AO pair's column in a packed factor, for a batch of ``batch``, on the device once."""
    return on_device(np.ascontiguousarray(np.broadcast_to(pair_index(nao_padded), (batch, nao_padded, nao_padded))))


def _ipu_backend(config: RKSConfig) -> IPUJK:
    ipu = config.ipu
    model = ipu_model(ipu.ipu_model, num_ipus=ipu.ipus, tiles=ipu.tiles, available_memory_proportion=ipu.ipu_memory_proportion)
    return IPUJK(model, ipu.jk_strategy)


JK_BACKENDS: dict[str, Callable[[RKSConfig], JKBackend]] = {
    "ipu": _ipu_backend,
    "dense": lambda config: DenseJK(),
    "s8": lambda config: S8JK(),
    "df": lambda config: FittedJK(),
}


def jk_matrices(backend: JKBackend, eri_s8: np.ndarray, nao: int, dm: np.ndarray,
                dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """J and K (each (N, N), numpy) of the symmetric density ``dm`` by ``backend``, in ``dtype``."""
    with precision_scope(np.dtype(dtype).name):
        data = backend.prepare(batch_eris([eri_s8], nao, dtype), nao, dtype)
        j, k = jax.jit(full_precision(jax.vmap(backend.contract)))(data, jnp.asarray(dm, dtype)[None])
        return np.asarray(j[0]), np.asarray(k[0])
