"""Density fitting as a J-K backend: the loop's contraction of the fitted factor, and what a fitted
run does around the loop (its host factor, memory, size buckets, finalisation, PySCF counterpart and
gradient), each where :class:`~pyscf_ipu.jk.exact.ExactERIs` answers for the exact ERIs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..buckets import OCCUPIED_STEP, SizeBucket, auxiliary_basis
from ..config import ConfigError
from ..memory import GB, batch_memory
from ..packed import FittedFactor, StreamedFactor, pair_index, rectangular_columns, rectangular_times
from ..prepare import fitted_eri
from ..programs import compiled, on_device
from ..two_electron_gradient import fitted_two_electron_gradient

if TYPE_CHECKING:
    from ..config import RKSConfig
    from ..method import Method

# density fitting's loop keeps a CPU's cores busy with one conformer: a batch would multiply the
# memory, not the speed (docs/decisions/jk-auto.md)
AUTO_FITTED_BATCH_ON_A_CPU = 1
STREAM_BLOCK = 64  # fitting functions a streamed factor reads at a time (docs/decisions/streamed-factor.md)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class FittedArrays:
    """A conformer's fitted J-K arrays: the unpacked factor, and the bucket's rank bound R (static)."""

    factor: jax.Array  # (Np, Qp, Np)  B_Q[i, j] at [i, Q, j]; zero for padded AOs and fitting functions
    packed: jax.Array  # (Qp, npair)  B over the pairs i >= j of the padded AOs
    exact: jax.Array  # (Qp, npair)  the same in float64: the finalisation's J reads it, the loop does not
    pairs: jax.Array  # (Np, Np) int32  each AO pair's column in ``packed``
    rank: int = field(metadata=dict(static=True))

    def loop_jk(self, dm):
        """The loop's (J, K) of ``dm`` (:meth:`FittedJK.contract`)."""
        y = exchange_factor(self.factor, density_factor(dm, self.rank))  # (R Qp, Np)
        return fitted_coulomb(self.packed, self.pairs, dm), y.T @ y

    def final_jk(self, dm):
        """The finalisation's (J, K, tr(D K)) of the float64 ``dm`` (:class:`FittedExchange`)."""
        w = density_factor(dm, self.rank).astype(self.factor.dtype)  # (Np, R)  D = W W^T
        y = exchange_factor(self.factor, w)  # (R Qp, Np)
        z = (y @ w).astype(dm.dtype)  # (R Qp, R)  the blocks W^T B_Q W
        return fitted_coulomb(self.exact, self.pairs, dm), (y.T @ y).astype(dm.dtype), jnp.sum(z * z)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StreamedArrays:
    """A conformer's fitted J-K arrays where its bucket streams the factor: the float64 factor alone, in
    the rectangular layout, of which each contraction reads :data:`STREAM_BLOCK` fitting functions at a
    time in the loop's precision (``dtype``); the same J and K as :class:`FittedArrays`, to rounding."""

    exact: jax.Array  # (Qp, npair)  float64, rectangular order (:func:`~pyscf_ipu.packed.rectangular_columns`)
    pairs: jax.Array  # (Np, Np) int32  each AO pair's column in ``exact``
    rank: int = field(metadata=dict(static=True))
    dtype: str = field(metadata=dict(static=True))

    def loop_jk(self, dm):
        """The loop's (J, K) of ``dm``, J from the same blocks (the loop traces without float64)."""
        j, k, _ = streamed_jk(self.exact, self.pairs, dm, density_factor(dm, self.rank), trace=False)
        return j, k

    def final_jk(self, dm):
        """The finalisation's (J, K, tr(D K)) of the float64 ``dm``, from the blocks: J in float64, K and
        its energy as :class:`FittedExchange` forms them."""
        w = density_factor(dm, self.rank).astype(self.dtype)  # (Np, R)  D = W W^T
        j, k, trace = streamed_jk(self.exact, self.pairs, dm, w, trace=True)
        return j, k.astype(dm.dtype), trace


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

    Where one conformer's arrays would not fit the memory budget, its bucket streams the factor
    (:meth:`laid_out`): the float64 copy alone is held, and each contraction reads it a block of
    fitting functions at a time (:class:`StreamedArrays`), less than half the memory for a slower K.
    """

    name: str = "df"
    occupied_step: ClassVar[int] = OCCUPIED_STEP  # its buckets round the occupied orbitals up to this
    profiles: ClassVar[bool] = False  # ``profile`` has nothing to report
    memory_advice: ClassVar[str] = ""  # nothing smaller to suggest: no N^4 array already

    def cpu_batch(self, bucket: SizeBucket) -> int:
        """``--batch-size auto`` on a CPU: :data:`AUTO_FITTED_BATCH_ON_A_CPU` conformers, whatever the bucket."""
        return AUTO_FITTED_BATCH_ON_A_CPU

    def laid_out(self, bucket: SizeBucket, method: Method) -> SizeBucket:
        """``bucket``, streaming its factor where one conformer's arrays held whole would exceed the
        run's memory budget (:attr:`~pyscf_ipu.method.Method.memory_budget`)."""
        if batch_memory(bucket, method, 1).total <= method.memory_budget * GB:
            return bucket
        return replace(bucket, streams_factor=True)

    def host_eris(self, mol, bucket: SizeBucket, config: RKSConfig) -> tuple[np.ndarray, int, np.ndarray]:
        """(empty s8 ERIs, 0, the fitted factor (naux, npair)) of ``mol`` from libcint: no N^4 array at all."""
        return np.zeros(0), 0, fitted_eri(mol, bucket.basis, config.eri_expcutoff)

    def eri_bytes(self, bucket: SizeBucket, held: int, fitting_bytes: int, value_bytes: int) -> tuple[int, int]:
        """(held, made): the factor in float64, and in the loop's precision (``value_bytes``) unless the
        bucket streams it, instead of the s8 ERIs (``held``); and what making it holds beside it
        (``fitting_bytes`` per value)."""
        values = bucket.naux_padded * bucket.nao_padded * (bucket.nao_padded + 1) // 2
        return (8 + (0 if bucket.streams_factor else value_bytes)) * values, fitting_bytes * values

    def keeps_final_eris(self, method: Method) -> bool:
        """Never: the finalisation reads the factor's float64 copy (:class:`FittedExchange`)."""
        return False

    def final_contraction(self, method: Method) -> FittedExchange:
        return FittedExchange()

    def pyscf_counterpart(self, mf, basis: str):
        """``mf`` density fitted in the same fitting basis: the difference then measures our code, not the fit."""
        elements = set(mf.mol.elements)
        return mf.density_fit(auxbasis={symbol: auxiliary_basis(basis, symbol) for symbol in elements})

    def two_electron_gradient(self, mol, config: RKSConfig, occupied: np.ndarray, exchange: float,
                              omega: float = 0.0) -> np.ndarray:  # fmt: skip
        """(natm, 3) the fitted two-electron energy's derivative at the orbitals ``occupied`` (N, nocc)
        (``omega`` > 0: of ``exchange`` E_K^ω alone, the fitted exchange energy of erf(ω r)/r)."""
        return fitted_two_electron_gradient(mol, config.basis, occupied, exchange, config.eri_expcutoff, omega)

    def prepare(self, eris: FittedFactor | StreamedFactor, nao_padded, dtype):
        if isinstance(eris, StreamedFactor):
            pairs = _pairs(nao_padded, len(eris.exact), True)
            return StreamedArrays(eris.exact, pairs, eris.rank, np.dtype(dtype).name)
        return FittedArrays(_unpacked_factors(eris.packed, nao_padded), eris.packed, eris.exact,
                            _pairs(nao_padded, len(eris.packed), False), eris.rank)  # fmt: skip

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        n, rank = bucket.nao_padded, bucket.occupied_rank
        if bucket.streams_factor:  # a block's rows, its unpacked matrices, its products and their copies
            return min(STREAM_BLOCK, bucket.naux_padded) * (2 * n * n + 4 * n * rank) * value_bytes
        # the unpacked factors and the loop's (Np, Qp, R) products (B_Q U w^(1/2), the products'
        # temporaries and their batched forms); the packed factors are the integral source's
        return bucket.naux_padded * (n**2 + 4 * n * rank) * value_bytes

    def resident_bytes(self, bucket, value_bytes):
        return 0 if bucket.streams_factor else bucket.naux_padded * bucket.nao_padded**2 * value_bytes

    def contract(self, data: FittedArrays | StreamedArrays, dm):
        return data.loop_jk(dm)


def fitted_backend(config: RKSConfig) -> FittedJK:
    """:class:`FittedJK` for ``config``; :class:`~pyscf_ipu.config.ConfigError` where it asks for
    Schwarz screening, which screens the s8 ERIs that density fitting never makes."""
    if config.eri_threshold:  # auto (None) and 0 screen nothing
        raise ConfigError(f"--eri-threshold screens the s8 ERIs, which --jk {config.jk} (density fitting) never makes")
    return FittedJK()


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


def streamed_jk(exact, pairs, dm, w, trace: bool):
    """(J, K, tr(D K)) from a factor ``exact`` (Qp, npair) in the rectangular layout, read
    :data:`STREAM_BLOCK` fitting functions at a time in the precision of ``w`` (Np, R), D = W W^T.

    Per block: its rows' rho_Q = tr(B_Q D) and their part of J over the packed pairs, then Y_Q = B_Q W
    (:func:`~pyscf_ipu.packed.rectangular_times`), K += sum_Q Y_Q Y_Q^T, and (``trace``) the squares
    of W^T Y_Q summed in ``dm``'s precision (else 0). A last block that would run past Qp starts
    earlier instead, its rows already counted zeroed. J and the rows are in ``dm``'s precision, K in ``w``'s."""
    q, n, rank = exact.shape[0], w.shape[0], w.shape[1]
    block = min(STREAM_BLOCK, q)
    dm_pairs = jnp.zeros(exact.shape[1], dm.dtype).at[pairs].add(dm)  # (npair,)  D_ij + D_ji on pair ij

    def step(i, carry):
        j_pairs, k, squares = carry
        start = jnp.minimum(i * block, q - block)
        rows = jax.lax.dynamic_slice_in_dim(exact, start, block, 0).astype(dm.dtype)  # (c, npair)
        rows = jnp.where((start + jnp.arange(block) >= i * block)[:, None], rows, 0.0)
        j_pairs = j_pairs + (rows @ dm_pairs) @ rows
        y = rectangular_times(rows.astype(w.dtype), w)  # (c, Np, R)
        columns = jnp.transpose(y, (1, 0, 2)).reshape(n, block * rank)  # (Np, c R)
        k = k + columns @ columns.T
        if trace:
            z = jnp.einsum("ir,qis->qrs", w, y).astype(squares.dtype)  # (c, R, R)  W^T B_Q W
            squares = squares + jnp.sum(z * z)
        return j_pairs, k, squares

    init = (jnp.zeros(exact.shape[1], dm.dtype), jnp.zeros((n, n), w.dtype), jnp.zeros((), dm.dtype))
    j_pairs, k, squares = jax.lax.fori_loop(0, -(-q // block), step, init)
    return j_pairs[pairs], k, squares


@partial(compiled, static_argnums=1, name="fitted_factors")
def _unpacked_factors(packed, nao_padded: int):
    """(C, Np, Qp, Np): each conformer's packed factor (Qp, npair) gathered onto its AO pairs, laid
    out so that B_Q U for all Q is one matrix product whose result K needs no transpose of."""
    index = jnp.asarray(pair_index(nao_padded))
    return jax.vmap(lambda factor: jnp.transpose(factor[:, index], (1, 0, 2)))(packed)


@lru_cache(maxsize=8)
def _pairs(nao_padded: int, batch: int, rectangular: bool) -> jax.Array:
    """(C, Np, Np) int32: each AO pair's column in a packed factor, row-packed or ``rectangular``, for a
    batch of ``batch``, on the device once."""
    columns = rectangular_columns(nao_padded) if rectangular else pair_index(nao_padded)
    return on_device(np.ascontiguousarray(np.broadcast_to(columns, (batch, nao_padded, nao_padded))))


@dataclass(frozen=True)
class FittedExchange:
    """Where the loop density-fits: J from the float64 factor (:func:`~pyscf_ipu.jk.fitted_coulomb`,
    what PySCF's density-fitting J computes), K from the loop's float32 factor, both on the device.

    K's two products are the loop's own (:meth:`~pyscf_ipu.jk.FittedJK.contract`), in float32 rather
    than float64 (the errors are in ``docs/decisions/density-fitting.md``). Its energy,
    tr(D K) = sum_Q ||W^T B_Q W||^2 with D = W W^T, comes from one more small product
    (R Q, N) x (N, R) whose squares are summed in float64: tr(D K) over the float32 K itself would
    carry K's rounding, about 1e-7 of the exchange energy, into the label.
    """

    forms_jk_on_device: ClassVar[bool] = True

    def device_arrays(self, jk, final):
        return jk

    def on_device(self, data: FittedArrays | StreamedArrays, dm):
        return data.final_jk(dm)

    def on_host(self, prepared, dm, final):
        raise AssertionError("a density-fitted finalisation forms J and K on the device")


__all__ = ["FittedArrays", "FittedExchange", "FittedJK", "StreamedArrays", "density_factor", "exchange_factor",
           "fitted_backend", "fitted_coulomb", "streamed_jk"]
