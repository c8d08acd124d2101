r"""J-K backends: the Coulomb and exchange contractions of the ERI with a density matrix.

.. math::

    J_{kl} = \sum_{ij} (ij|kl) D_{ij}, \qquad K_{il} = \sum_{jk} (ij|kl) D_{jk}

in einsum form ``J = einsum('ijkl,ij->kl', eri, D)`` and ``K = einsum('ijkl,jk->il', eri, D)``.

A backend is a frozen (hashable) object with two methods:

- ``prepare(eri_s8, nao, nao_padded, dtype, kept=None) -> dict of arrays``: once per molecule,
  outside the loop. The arrays' shapes may depend only on padded sizes, so molecules in one bucket
  share compiled code. ``kept``, where given, is ``eri_s8``'s non-zero count
  (``HostProblem.eri_kept``), which a backend that plans by sizes need not count again.
- ``prepare_batch(eris, nao, nao_padded, dtype, kept=None) -> dict of arrays``: the same for the
  conformers of a batch (``kept`` a list), stacked along a leading axis (``prepare`` of each,
  stacked by :func:`~pyscf_ipu.padding.stack_members`, unless the backend can do better).
- ``contract(data, dm) -> (J, K)``: pure JAX, traced inside the jitted SCF step.

- ``profile(eri_s8, nao, nao_padded, dtype, iterations, kept=None) -> dict | None``: how the work
  is spread.

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
from .packed import degeneracy_weights, s8_accumulate, symmetrise, unique_quartets
from .ipu import IPUJK, ipu_model
from .padding import bucket, pad_to, stack_members


class JKBackend(Protocol):
    name: str

    def prepare(self, eri_s8: np.ndarray, nao: int, nao_padded: int, dtype,
                kept: int | None = None) -> dict[str, np.ndarray]: ...  # fmt: skip

    def prepare_batch(self, eris: list[np.ndarray], nao: int, nao_padded: int, dtype,
                      kept: list[int] | None = None) -> dict[str, jax.Array]: ...  # fmt: skip

    def contract(self, data: dict, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]: ...

    def profile(self, eri_s8: np.ndarray, nao: int, nao_padded: int, dtype, iterations: int,
                kept: int | None = None) -> dict | None:  # fmt: skip
        """A report of how the backend spreads the work (None if it has nothing to say)."""


@dataclass(frozen=True)
class DenseJK:
    """The reference: both contractions as matrix-vector products over (N^2, N^2) ERI matrices.

    Memory is 2 N^4 values, so this is for small molecules and for checking the others.
    """

    name: str = "dense"

    def prepare(self, eri_s8, nao, nao_padded, dtype, kept=None):
        eri_s8 = np.asarray(eri_s8, np.float64)  # device integrals come in float32; ao2mo reads doubles
        eri = ao2mo.restore(1, eri_s8, nao).astype(dtype)  # (N, N, N, N)
        return _dense_matrices(jnp.asarray(eri), nao_padded)

    def prepare_batch(self, eris, nao, nao_padded, dtype, kept=None):
        return stack_members([self.prepare(eri, nao, nao_padded, dtype) for eri in eris])

    def profile(self, eri_s8, nao, nao_padded, dtype, iterations, kept=None):
        return None

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

    def prepare(self, eri_s8, nao, nao_padded, dtype, kept=None):
        values, index = unique_quartets(eri_s8, nao)
        values = values * degeneracy_weights(index)
        size = bucket(len(values), minimum=1024)
        return {
            "values": pad_to(values, (size,), dtype),
            "index": pad_to(index, (size, 4)),
        }

    def prepare_batch(self, eris, nao, nao_padded, dtype, kept=None):
        return stack_members([self.prepare(eri, nao, nao_padded, dtype) for eri in eris])

    def profile(self, eri_s8, nao, nao_padded, dtype, iterations, kept=None):
        return None

    def contract(self, data, dm):
        return symmetrise(s8_accumulate(data["values"], data["index"], dm))


def _ipu_backend(config: RKSConfig) -> IPUJK:
    model = ipu_model(
        config.ipu_model,
        num_ipus=config.ipus,
        tiles=config.tiles,
        available_memory_proportion=config.ipu_memory_proportion,
    )
    return IPUJK(model, config.jk_strategy)


JK_BACKENDS: dict[str, Callable[[RKSConfig], JKBackend]] = {
    "ipu": _ipu_backend,
    "dense": lambda config: DenseJK(),
    "s8": lambda config: S8JK(),
}


def jk_matrices(name: str, eri_s8: np.ndarray, nao: int, dm: np.ndarray, dtype=np.float32,
                config: RKSConfig | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """J and K (each (N, N), numpy) of the symmetric density ``dm`` by the backend ``name``, in ``dtype``."""
    backend = get_jk_backend(name, config)
    with precision_scope(np.dtype(dtype).name):
        data = backend.prepare(eri_s8, nao, nao, dtype)
        j, k = jax.jit(backend.contract)(data, jnp.asarray(dm, dtype))
        return np.asarray(j), np.asarray(k)


def get_jk_backend(name: str, config: RKSConfig | None = None) -> JKBackend:
    """The J-K backend registered under ``name``, set up from ``config`` (default settings if None)."""
    try:
        factory = JK_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown J-K backend {name!r}: choose one of {', '.join(JK_BACKENDS)}") from None
    return factory(config or RKSConfig())
