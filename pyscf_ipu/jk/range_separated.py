r"""The J-K backend of a range-separated hybrid: any backend, run over two operators.

A range-separated hybrid (ωB97X) adds exact exchange of two operators: a fraction a of the Coulomb
operator's K and a fraction b of the long-range K_ω, from erf(ω r)/r,

.. math::

    K_{\text{exact}} = a K + b K_\omega, \qquad
    F = H + J - \tfrac12 K_{\text{exact}} + V_{xc}, \qquad
    E_x^{\text{exact}} = -\tfrac14 \mathrm{tr}(D K_{\text{exact}}).

:class:`RangeSeparatedJK` wraps the run's backend: the integral source hands it both operators'
integrals (:class:`~pyscf_ipu.packed.RangeSeparatedERIs`), it lays out each with the wrapped backend
and contracts both, J from the Coulomb operator, and returns :math:`K_{\text{exact}}` in place of K;
the functional's :attr:`~pyscf_ipu.xc.functionals.Functional.exchange_factor` is then 1. The float64
finalisation does the same with the wrapped backend's own contraction (:class:`RangeSeparatedContraction`).
The second contraction also forms a J that is not used: ``docs/decisions/range-separated-exchange.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import ConfigError
from ..packed import RangeSeparatedERIs
from ..strategies import JKBackend

from ..xc.functionals import Functional

if TYPE_CHECKING:
    from ..method import Method


def exchange_sum(functional: Functional, k, k_long):
    """a K + b K_ω (or the same of their traces with the density), ``functional``'s weights."""
    return functional.hf_exchange * k + functional.long_range_exchange * k_long


@dataclass(frozen=True)
class RangeSeparatedJK:
    """``inner`` over the Coulomb and the long-range integrals: (J, a K + b K_ω) with ``functional``'s
    a = ``hf_exchange`` and b = ``long_range_exchange``."""

    inner: JKBackend
    functional: Functional

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def occupied_step(self) -> int:
        return self.inner.occupied_step

    @property
    def profiles(self) -> bool:
        return False

    def cpu_batch(self, bucket):
        return self.inner.cpu_batch(bucket)

    @property
    def memory_advice(self) -> str:
        return self.inner.memory_advice

    def prepare(self, eris: RangeSeparatedERIs, nao_padded, dtype) -> RangeSeparatedERIs:
        return RangeSeparatedERIs(self.inner.prepare(eris.coulomb, nao_padded, dtype),
                                  self.inner.prepare(eris.long_range, nao_padded, dtype))  # fmt: skip

    def contract(self, data: RangeSeparatedERIs, dm):
        vj, vk = self.inner.contract(data.coulomb, dm)
        _, vk_long = self.inner.contract(data.long_range, dm)
        return vj, exchange_sum(self.functional, vk, vk_long)

    def profile(self, eri, nao_padded, dtype, iterations):
        return None

    def layout_bytes(self, bucket, value_bytes):
        # the second layout is made while the first is held
        return self.inner.layout_bytes(bucket, value_bytes) + self.inner.resident_bytes(bucket, value_bytes)

    def resident_bytes(self, bucket, value_bytes):
        return 2 * self.inner.resident_bytes(bucket, value_bytes)

    def laid_out(self, bucket, method):
        """The wrapped backend's layout of ``bucket``, judged on both operators' arrays (``method``'s
        backend is this one): a streamed density-fitted bucket streams both factors."""
        return self.inner.laid_out(bucket, method)

    def host_eris(self, mol, bucket, config):
        raise ConfigError("a range-separated functional's integrals are made by the JAX integral source only")

    def eri_bytes(self, bucket, held, fitting_bytes, value_bytes):
        held, made = self.inner.eri_bytes(bucket, held, fitting_bytes, value_bytes)
        return 2 * held, made

    def keeps_final_eris(self, method: Method) -> bool:
        return self.inner.keeps_final_eris(method)

    def final_contraction(self, method: Method) -> RangeSeparatedContraction:
        """The wrapped backend's own, run over both operators (it sees itself as the run's backend)."""
        return RangeSeparatedContraction(self.inner.final_contraction(replace(method, backend=self.inner)),
                                         self.functional)  # fmt: skip

    def pyscf_counterpart(self, mf, basis: str):
        """``mf`` as the wrapped backend computes it: PySCF's own range separation comes with its ``xc``."""
        return self.inner.pyscf_counterpart(mf, basis)

    def two_electron_gradient(self, mol, config, occupied, exchange, omega=0.0):
        """(natm, 3) the derivative of E_J + a E_K + b E_K^ω: the wrapped backend's at a, and its long-range
        exchange's at b (the weights and ω are the functional's; ``exchange`` and ``omega`` are not read)."""
        f = self.functional
        coulomb = self.inner.two_electron_gradient(mol, config, occupied, f.hf_exchange)
        return coulomb + self.inner.two_electron_gradient(mol, config, occupied, f.long_range_exchange, f.omega)


@dataclass(frozen=True)
class RangeSeparatedContraction:
    """The finalisation's J, a K + b K_ω and its trace with the density, by the wrapped backend's own
    :class:`~pyscf_ipu.finalisation.FinalContraction` ``inner`` over both operators, on the device."""

    inner: object
    functional: Functional

    @property
    def forms_jk_on_device(self) -> bool:
        return self.inner.forms_jk_on_device

    def device_arrays(self, jk: RangeSeparatedERIs, final):
        def of(operator: str):
            eris = final.eris
            own = replace(final, eris=getattr(eris, operator)) if isinstance(eris, RangeSeparatedERIs) else final
            return self.inner.device_arrays(getattr(jk, operator), own)

        return RangeSeparatedERIs(of("coulomb"), of("long_range"))

    def on_device(self, data: RangeSeparatedERIs, dm):
        vj, vk, trace = self.inner.on_device(data.coulomb, dm)
        _, vk_long, trace_long = self.inner.on_device(data.long_range, dm)
        return vj, exchange_sum(self.functional, vk, vk_long), exchange_sum(self.functional, trace, trace_long)

    def on_host(self, prepared, dm, final):
        raise AssertionError("a range-separated finalisation forms J and K on the device")


def range_separated(backend: JKBackend, functional: Functional, integrals) -> RangeSeparatedJK:
    """``backend`` wrapped for ``functional``'s long-range exchange; :class:`ConfigError` where the run's
    ``integrals`` (an integral source) cannot make the long-range integrals for it."""
    if not integrals.long_range(backend):
        raise ConfigError(f"--xc {functional.name} (range-separated exchange) needs, for now, the JAX "
                          f"integrals: --integrals auto or jax (got --jk {backend.name} --integrals "
                          f"{integrals.name})")  # fmt: skip
    return RangeSeparatedJK(backend, functional)


__all__ = ["RangeSeparatedContraction", "RangeSeparatedJK", "range_separated"]
