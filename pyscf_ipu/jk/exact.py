"""The backends that contract the exact (s8-packed) ERIs, and what such a run does elsewhere.

:class:`ExactERIs` is what every exact backend (``dense``, ``s8`` and the simulated IPU's ``ipu``)
answers for the stages around the loop: the host's ERIs, their memory, the size buckets' step, the
finalisation's contraction, PySCF's counterpart and the two-electron gradient. A density-fitted
backend answers the same questions its own way (:class:`~pyscf_ipu.jk.fitted.FittedJK`), so no
other module asks which kind a run uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..buckets import SizeBucket
from ..packed import (degeneracy_weights, pair_index, quartet_bytes, s8_accumulate, s8_size, s8_to_s4, symmetrise,
                      unique_quartets)
from ..padding import padded_size, pad_to, stack_members
from ..prepare import eri_s8, schwarz_screen
from ..programs import compiled
from ..two_electron_gradient import exact_two_electron_gradient

if TYPE_CHECKING:
    from ..config import RKSConfig
    from ..method import Method

AUTO_BATCH_ON_A_CPU = 8  # conformers: a CPU's cores are as busy with 8 as with more
# one conformer's float32 s8 ERIs from which a CPU takes one conformer per batch (about 15 heavy atoms at STO-3G):
# its loop is then bound by memory bandwidth alone, and a batch only waits for its slowest member
ONE_AT_A_TIME_BYTES = 16 * 2**20


class ExactERIs:
    """What a backend of the exact s8 ERIs changes around the loop (a base of those backends)."""

    occupied_step: ClassVar[int] = 0  # its size buckets do not depend on the occupied orbitals
    profiles: ClassVar[bool] = False  # whether ``profile`` reports how it spreads the work (``--profile``)
    # what a memory error suggests first where not even one conformer fits
    memory_advice: ClassVar[str] = "--jk df (density fitting: no N^4 array), "

    def laid_out(self, bucket: SizeBucket, method) -> SizeBucket:
        """``bucket`` itself: the s8 ERIs have one layout."""
        return bucket

    def cpu_batch(self, bucket: SizeBucket) -> int:
        """``--batch-size auto`` on a CPU: :data:`AUTO_BATCH_ON_A_CPU` conformers, or one where a
        conformer's float32 s8 ERIs reach :data:`ONE_AT_A_TIME_BYTES` (``docs/decisions/batch-of-one.md``)."""
        return 1 if 4 * s8_size(bucket.nao_padded) >= ONE_AT_A_TIME_BYTES else AUTO_BATCH_ON_A_CPU

    def host_eris(self, mol, bucket: SizeBucket, config: RKSConfig) -> tuple[np.ndarray, int, np.ndarray]:
        """(s8 ERIs, their count after Schwarz screening, an empty fitted factor) of ``mol`` from libcint."""
        eri = eri_s8(mol, config.eri_expcutoff)
        threshold = config.eri_screening(eri.dtype)
        if threshold > 0:
            nao = mol.nao_nr()
            eri = schwarz_screen(eri, nao * (nao + 1) // 2, threshold)
        return eri, int(np.count_nonzero(eri)), np.zeros((0, 0))

    def eri_bytes(self, bucket: SizeBucket, held: int, fitting_bytes: int, value_bytes: int) -> tuple[int, int]:
        """(held, made): the host bytes of one conformer's ERIs, given the integral source's ``held``
        for the s8 array, and those held only while they are made (none beside the s8 array)."""
        return held, 0

    def keeps_final_eris(self, method: Method) -> bool:
        """Whether the finalisation contracts the ERIs as computed on the device, beside the loop's
        rounded copy: where the integral source computes them there more precisely than the loop reads
        them (the JAX integrals' float64 ERIs under a float32 loop)."""
        integrals = method.integrals
        return integrals.eris_on_device and integrals.eri_dtype(method) != np.dtype(method.dtype)

    def final_contraction(self, method: Method):
        """The float64 finalisation's J and K (:class:`~pyscf_ipu.finalisation.FinalContraction`): the
        device's float64 ERIs where it keeps them, the loop's own backend where the loop holds them as
        computed, else PySCF's contraction of libcint's float64 ERIs on the host."""
        if self.keeps_final_eris(method):
            return DeviceERIs()
        if method.integrals.eris_on_device:
            return LoopBackend(method.backend)
        return LibcintERIs()

    def pyscf_counterpart(self, mf, basis: str):
        """PySCF's mean-field object ``mf`` as it computes what this backend does: unchanged."""
        return mf

    def two_electron_gradient(self, mol, config: RKSConfig, occupied: np.ndarray, exchange: float,
                              omega: float = 0.0) -> np.ndarray:  # fmt: skip
        """(natm, 3) the exact two-electron energy's derivative at the orbitals ``occupied`` (N, nocc)
        (``omega`` > 0: of ``exchange`` E_K^ω alone, the exchange energy of erf(ω r)/r)."""
        return exact_two_electron_gradient(mol, config.basis, occupied, exchange, config.precision, omega)


@dataclass(frozen=True)
class DenseJK(ExactERIs):
    """The reference: both contractions as matrix-vector products over (N^2, N^2) ERI matrices.

    Memory is 2 N^4 values, so this is for small molecules and for checking the others.
    """

    name: str = "dense"

    def prepare(self, eris, nao_padded, dtype):
        return _dense_matrices(eris, nao_padded, np.dtype(dtype).name)

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        # the s4 unpacking, the (N,)*4 tensor and its two layouts
        return bucket.nao_padded**4 * 4 * value_bytes

    def resident_bytes(self, bucket, value_bytes):
        return bucket.nao_padded**4 * 2 * value_bytes

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


@partial(compiled, static_argnums=(1, 2), name="dense_layout")
def _dense_matrices(eris, nao_padded, dtype: str):
    """Each conformer's s8 ERIs (C, size) as the J and K matrices (C, Np^2, Np^2) in ``dtype``, on the device."""
    npair = nao_padded * (nao_padded + 1) // 2
    pairs = jnp.asarray(pair_index(nao_padded)).reshape(-1)

    def member(s8):
        full = s8_to_s4(s8.astype(dtype), npair)[pairs][:, pairs]  # [(ij), (kl)]: (ij|kl); symmetric
        eri = full.reshape((nao_padded,) * 4)
        return {"eri_j": full, "eri_k": eri.transpose(0, 3, 1, 2).reshape(full.shape)}  # [(il), (jk)]

    return jax.vmap(member)(eris)


@dataclass(frozen=True)
class S8JK(ExactERIs):
    """Unique (8-fold symmetric) screened integrals with int16 indices: gather, multiply, scatter-add.

    Stores about N^4/8 values instead of 2 N^4, padded with zero-valued quartets to a size bucket.
    """

    name: str = "s8"

    def prepare(self, eris, nao_padded, dtype):
        # the unique integrals are sorted out on the host (a scatter's index list)
        quartets = [unique_quartets(s8, nao_padded) for s8 in np.asarray(eris, dtype)]
        size = padded_size(max(len(values) for values, _ in quartets), minimum=1024)  # one shape for the batch
        return stack_members([{"values": pad_to(values * degeneracy_weights(index), (size,), dtype),
                               "index": pad_to(index, (size, 4))} for values, index in quartets])  # fmt: skip

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        return quartet_bytes(bucket.nao_padded, value_bytes)

    def resident_bytes(self, bucket, value_bytes):
        return quartet_bytes(bucket.nao_padded, value_bytes)

    def contract(self, data, dm):
        return symmetrise(s8_accumulate(data["values"], data["index"], dm))


# The float64 finalisation's contractions of an exact run (:meth:`ExactERIs.final_contraction`).


@dataclass(frozen=True)
class DeviceERIs:
    """J and K in float64 on the device from the float64 ERIs that the batch's final inputs hold (the
    JAX integrals compute them there; the loop holds them only rounded)."""

    forms_jk_on_device: ClassVar[bool] = True

    def device_arrays(self, jk, final):
        return final.eris

    def on_device(self, data, dm):
        vj, vk = s8_coulomb_exchange(data, dm)
        return vj, vk, jnp.sum(dm * vk)

    def on_host(self, prepared, dm, final):
        raise AssertionError("the device's float64 ERIs form J and K on the device")


@dataclass(frozen=True)
class LoopBackend:
    """J and K by the loop's own ``backend`` over its arrays, summed in float64, on the device: where
    the loop holds the ERIs as the JAX integrals computed them (one pass of the loop's contraction,
    where :class:`DeviceERIs` unpacks the s8 array row by row)."""

    backend: object  # a J-K backend
    forms_jk_on_device: ClassVar[bool] = True

    def device_arrays(self, jk, final):
        return jk

    def on_device(self, data, dm):
        vj, vk = self.backend.contract(data, dm)
        return vj, vk, jnp.sum(dm * vk)

    def on_host(self, prepared, dm, final):
        raise AssertionError("the loop's backend forms J and K on the device")


@dataclass(frozen=True)
class LibcintERIs:
    """J and K by PySCF from the host's float64 libcint ERIs, which a float32 loop holds only
    rounded; nothing on the device."""

    forms_jk_on_device: ClassVar[bool] = False

    def device_arrays(self, jk, final):
        return {}

    def on_device(self, data, dm):
        return None, None, None

    def on_host(self, prepared, dm, final):
        from pyscf import scf

        vj, vk = scf.hf.dot_eri_dm(prepared.eri_s8, dm, hermi=1)
        return vj, vk, np.sum(dm * vk)


__all__ = ["DenseJK", "DeviceERIs", "ExactERIs", "LibcintERIs", "LoopBackend", "S8JK", "s8_coulomb_exchange"]
