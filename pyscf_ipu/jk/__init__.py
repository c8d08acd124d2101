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

A backend also answers what its kind of integrals changes around the loop, so that no other module
asks which backend a run uses: the host's ERIs (``host_eris``), their memory (``eri_bytes``), the
size buckets' step (``occupied_step``), the batch on a CPU (``cpu_batch``), the float64
finalisation's contraction (``final_contraction``), PySCF's counterpart (``pyscf_counterpart``) and
the two-electron gradient (``two_electron_gradient``): :class:`~pyscf_ipu.jk.exact.ExactERIs` for the
exact ERIs, :class:`~pyscf_ipu.jk.fitted.FittedJK` for density fitting.

Backends are registered by name in :data:`JK_BACKENDS` (each entry builds the backend from the run's
:class:`RKSConfig`; :func:`pyscf_ipu.resolution.resolve` picks one; the interface,
:class:`~pyscf_ipu.strategies.JKBackend`, sits below every stage that takes a backend); nothing inspects array shapes to
pick one. ``ipu`` is the tile-partitioned contraction on a simulated IPU (:mod:`pyscf_ipu.ipu`), ``dense``
the reference, ``s8`` the unique quartets (:mod:`pyscf_ipu.jk.exact`), and ``df`` contracts
density-fitted integrals (:mod:`pyscf_ipu.jk.fitted`; no N^4 array at all).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..buckets import SizeBucket
from ..config import RKSConfig
from ..packed import PackedERI, batch_eris
from ..programs import full_precision, precision_scope
from ..strategies import JKBackend
from .exact import DenseJK, ExactERIs, S8JK, s8_coulomb_exchange
from .fitted import FittedArrays, FittedJK, density_factor, exchange_factor, fitted_backend, fitted_coulomb


def _ipu_backend(config: RKSConfig) -> JKBackend:
    from ..ipu import IPUJK, ipu_model  # the simulated IPU's backend builds on :class:`ExactERIs`

    ipu = config.ipu
    model = ipu_model(ipu.ipu_model, num_ipus=ipu.ipus, tiles=ipu.tiles, available_memory_proportion=ipu.ipu_memory_proportion)
    return IPUJK(model, ipu.jk_strategy)


JK_BACKENDS: dict[str, Callable[[RKSConfig], JKBackend]] = {
    "ipu": _ipu_backend,
    "dense": lambda config: DenseJK(),
    "s8": lambda config: S8JK(),
    "df": fitted_backend,
}


def jk_matrices(backend: JKBackend, eri_s8: np.ndarray, nao: int, dm: np.ndarray,
                dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """J and K (each (N, N), numpy) of the symmetric density ``dm`` by ``backend``, in ``dtype``."""
    with precision_scope(np.dtype(dtype).name):
        data = backend.prepare(batch_eris([eri_s8], nao, dtype), nao, dtype)
        j, k = jax.jit(full_precision(jax.vmap(backend.contract)))(data, jnp.asarray(dm, dtype)[None])
        return np.asarray(j[0]), np.asarray(k[0])


__all__ = ["DenseJK", "ExactERIs", "FittedArrays", "FittedJK", "JKBackend", "JK_BACKENDS", "S8JK", "density_factor",
           "exchange_factor", "fitted_coulomb", "jk_matrices", "s8_coulomb_exchange"]
