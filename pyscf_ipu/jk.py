r"""J-K backends: the Coulomb and exchange contractions of the ERI with a density matrix.

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}

in einsum form ``J = einsum('ijkl,ij->kl', eri, D)`` and ``K = einsum('ijkl,jk->il', eri, D)``.

A backend is a frozen (hashable) object:

- ``prepare(eris, nao_padded, dtype) -> dict of arrays``: once per batch of conformers, outside
  the loop, their arrays stacked along a leading axis. ``eris`` are the conformers'
  :class:`~pyscf_ipu.packed.PackedERI` records, laid out for ``nao_padded`` AOs in ``dtype``. The
  arrays' shapes may depend only on padded sizes, so molecules in one bucket share compiled code.
- ``contract(data, dm) -> (J, K)``: one conformer's, pure JAX, traced inside the SCF loop (which
  the loop's program vmaps over the batch).
- ``profile(eri, nao_padded, dtype, iterations) -> dict | None``: how the work of one conformer
  (its ``PackedERI``) is spread, computed only when asked for.
- ``layout_bytes(nao_padded, value_bytes) -> int``: the host and device memory that ``prepare``
  takes for one conformer's unscreened ERIs at its peak, its temporaries included (for
  :mod:`pyscf_ipu.memory`).

Backends are chosen by name from :data:`JK_BACKENDS` (each entry builds the backend from the run's
:class:`RKSConfig`); nothing inspects array shapes to pick one. ``ipu`` (the default) is the
tile-partitioned contraction on a simulated IPU (:mod:`pyscf_ipu.ipu`); ``dense`` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from pyscf import ao2mo

from .config import RKSConfig, precision_scope
from .packed import PackedERI, degeneracy_weights, quartet_bytes, s8_accumulate, symmetrise, unique_quartets
from .ipu import IPUJK, ipu_model
from .padding import bucket, pad_to, stack_members
from .programs import full_precision


class JKBackend(Protocol):
    name: str

    def prepare(self, eris: list[PackedERI], nao_padded: int, dtype) -> dict[str, jax.Array]: ...

    def contract(self, data: dict, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]: ...

    def profile(self, eri: PackedERI, nao_padded: int, dtype, iterations: int) -> dict | None:
        """A report of how the backend spreads the work (None if it has nothing to say)."""

    def layout_bytes(self, nao_padded: int, value_bytes: int) -> int:
        """Peak bytes of ``prepare`` for one conformer's unscreened ERIs."""



@dataclass(frozen=True)
class HostContraction:
    """No contraction on the device: what the float64 finalisation gets where the host's float64
    ERIs are more exact than the loop's (libcint's integrals in a float32 loop); it contracts them there."""

    name: str = "host"

    def contract(self, data, dm):
        return None, None


@dataclass(frozen=True)
class DenseJK:
    """The reference: both contractions as matrix-vector products over (N^2, N^2) ERI matrices.

    Memory is 2 N^4 values, so this is for small molecules and for checking the others.
    """

    name: str = "dense"

    def prepare(self, eris, nao_padded, dtype):
        # device integrals come in float32; ao2mo reads doubles
        members = [ao2mo.restore(1, np.asarray(e.s8, np.float64), e.nao).astype(dtype) for e in eris]  # (N,)*4 each
        return stack_members([_dense_matrices(jnp.asarray(eri), nao_padded) for eri in members])

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, nao_padded, value_bytes):
        # the float64 (N,)*4 tensor from ao2mo, its cast, and the padded tensor with its two layouts
        return nao_padded**4 * (8 + 4 * value_bytes)

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


@dataclass(frozen=True)
class S8JK:
    """Unique (8-fold symmetric) screened integrals with int16 indices: gather, multiply, scatter-add.

    Stores about N^4/8 values instead of 2 N^4, padded with zero-valued quartets to a size bucket.
    """

    name: str = "s8"

    def prepare(self, eris, nao_padded, dtype):
        quartets = [unique_quartets(e.s8, e.nao) for e in eris]
        size = bucket(max(len(values) for values, _ in quartets), minimum=1024)  # one shape for the batch
        return stack_members([{"values": pad_to(values * degeneracy_weights(index), (size,), dtype),
                               "index": pad_to(index, (size, 4))} for values, index in quartets])  # fmt: skip

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, nao_padded, value_bytes):
        return quartet_bytes(nao_padded, value_bytes)

    def contract(self, data, dm):
        return symmetrise(s8_accumulate(data["values"], data["index"], dm))


def _ipu_backend(config: RKSConfig) -> IPUJK:
    ipu = config.ipu
    model = ipu_model(ipu.ipu_model, num_ipus=ipu.ipus, tiles=ipu.tiles, available_memory_proportion=ipu.ipu_memory_proportion)
    return IPUJK(model, ipu.jk_strategy)


JK_BACKENDS: dict[str, Callable[[RKSConfig], JKBackend]] = {
    "ipu": _ipu_backend,
    "dense": lambda config: DenseJK(),
    "s8": lambda config: S8JK(),
}


def jk_matrices(name: str, eri_s8: np.ndarray, nao: int, dm: np.ndarray, dtype=np.float32,
                config: RKSConfig = RKSConfig()) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """J and K (each (N, N), numpy) of the symmetric density ``dm`` by the backend ``name``, in ``dtype``."""
    backend = get_jk_backend(name, config)
    with precision_scope(np.dtype(dtype).name):
        data = backend.prepare([PackedERI.of(eri_s8)], nao, dtype)
        j, k = jax.jit(full_precision(jax.vmap(backend.contract)))(data, jnp.asarray(dm, dtype)[None])
        return np.asarray(j[0]), np.asarray(k[0])


def get_jk_backend(name: str, config: RKSConfig = RKSConfig()) -> JKBackend:
    """The J-K backend registered under ``name``, set up from ``config``."""
    try:
        factory = JK_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown J-K backend {name!r}: choose one of {', '.join(JK_BACKENDS)}") from None
    return factory(config)
