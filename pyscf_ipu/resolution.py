"""The one place where a run's names become objects: :func:`resolve`, an
:class:`~pyscf_ipu.config.RKSConfig` -> :class:`~pyscf_ipu.method.Method`.

The functional (:data:`~pyscf_ipu.xc.functionals.FUNCTIONALS`), the J-K backend
(:data:`~pyscf_ipu.jk.JK_BACKENDS`), the integral source
(:data:`~pyscf_ipu.integral_sources.INTEGRAL_SOURCES`), the dispersion
(:data:`~pyscf_ipu.dispersion.DISPERSIONS`), the size buckets' step and the precision
are looked up here, above the strategies they name; the :class:`~pyscf_ipu.method.Method` they make
sits below them.
"""

from __future__ import annotations

import jax

from .buckets import default_bucket_step
from .config import AUTO, ConfigError, RKSConfig
from .dispersion import DISPERSIONS
from .integral_sources import INTEGRAL_SOURCES, auto_integrals
from .jk import JK_BACKENDS
from .jk.range_separated import range_separated
from .memory import default_budget
from .method import Method
from .xc.functionals import FUNCTIONALS


def resolve(config: RKSConfig, memory_budget: float | None = None) -> Method:
    """``config``'s functional, J-K backend and integral source as objects, and its size buckets' step
    (``auto``: by the platform, :func:`~pyscf_ipu.buckets.default_bucket_step`); :class:`ConfigError`
    naming the choices where a name is unknown (functional names are case-insensitive).
    ``memory_budget`` (GB; by default :func:`~pyscf_ipu.memory.default_budget`) is what the J-K backend
    lays each size bucket's arrays out for."""
    functional = _named(FUNCTIONALS, str(config.xc).strip().lower(), config.xc, "functional")
    backend = _named(JK_BACKENDS, config.jk, config.jk, "J-K backend")(config)
    if config.integrals == AUTO:  # by the platform the programs run on
        integrals = auto_integrals(jax.default_backend())
    else:
        integrals = _named(INTEGRAL_SOURCES, config.integrals, config.integrals, "integral source")
    step = config.bucket_step or default_bucket_step(jax.default_backend())
    dispersion = _named(DISPERSIONS, str(config.dispersion).strip().lower(), config.dispersion, "dispersion")
    dispersion.check(functional)
    if functional.range_separated:  # the backend contracts the long-range exchange too
        backend = range_separated(backend, functional, integrals)
    budget = default_budget() if memory_budget is None else memory_budget
    return Method(config, functional, backend, integrals, step, dispersion, budget)


def _named(registry: dict, key: str, given, what: str):
    try:
        return registry[key]
    except KeyError:
        raise ConfigError(f"unknown {what} {given!r}: choose one of {', '.join(sorted(registry))}") from None
