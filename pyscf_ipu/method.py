"""A run's settings resolved, once, into the objects that carry them out.

:func:`resolve` is the one place where the names in an :class:`~pyscf_ipu.config.RKSConfig` become
objects: the functional (:data:`~pyscf_ipu.xc.functionals.FUNCTIONALS`), the J-K backend
(:data:`~pyscf_ipu.jk.JK_BACKENDS`), the integral source
(:data:`~pyscf_ipu.integral_sources.INTEGRAL_SOURCES`) and the precision. Every later stage (the
preparation, the batched loop, the finalisation, the memory estimate, the generator) takes the
:class:`Method` it returns; none of them looks a name up again.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from .buckets import SizeBucket
from .config import AUTO, ConfigError, RKSConfig
from .integral_sources import INTEGRAL_SOURCES, IntegralSource, auto_integrals
from .jk import JK_BACKENDS, JKBackend
from .molecule import Molecule
from .xc.functionals import FUNCTIONALS, Functional


@dataclass(frozen=True)
class LoopSettings:
    """The static (compile-time) part of the SCF loop: changing any of these retraces it."""

    functional: Functional
    backend: JKBackend
    max_iterations: int
    diis_space: int
    stop_threshold: float  # on max|FDS - SDF|; 0 never stops early
    convergence_std_ev: float


@dataclass(frozen=True)
class Method:
    """An :class:`RKSConfig` with its names resolved: what a run computes, and with what."""

    config: RKSConfig  # the settings as given, recorded with every result
    functional: Functional
    backend: JKBackend
    integrals: IntegralSource

    @property
    def dtype(self) -> np.dtype:
        """The SCF loop's floating-point type."""
        return np.dtype(self.config.precision)

    @property
    def needs_grid(self) -> bool:
        """Whether the functional has a part on the grid (Hartree-Fock has none)."""
        return bool(self.functional.pieces)

    def bucket(self, molecule: Molecule) -> SizeBucket:
        """``molecule``'s size bucket under these settings (:meth:`bucket_of`)."""
        return self.bucket_of(molecule.symbols, molecule.charge)

    def bucket_of(self, symbols, charge: int = 0) -> SizeBucket:
        """The size bucket of a molecule of ``symbols`` (with ``charge``) at this basis and grid level,
        at the J-K backend's occupied-orbital step; :class:`~pyscf_ipu.molecule.MoleculeError` where
        the basis lacks an element."""
        config = self.config
        return SizeBucket.of_symbols(symbols, config.basis, config.grid_level, self.backend.occupied_step, charge)

    @property
    def loop(self) -> LoopSettings:
        config = self.config
        return LoopSettings(self.functional, self.backend, config.max_iterations, config.diis_space,
                            config.stop_threshold, config.convergence_std_ev)  # fmt: skip


def resolve(config: RKSConfig) -> Method:
    """``config``'s functional, J-K backend and integral source as objects; :class:`ConfigError`
    naming the choices where a name is unknown (functional names are case-insensitive)."""
    functional = _named(FUNCTIONALS, str(config.xc).strip().lower(), config.xc, "functional")
    backend = _named(JK_BACKENDS, config.jk, config.jk, "J-K backend")(config)
    if config.integrals == AUTO:  # by the platform the programs run on
        integrals = auto_integrals(jax.default_backend())
    else:
        integrals = _named(INTEGRAL_SOURCES, config.integrals, config.integrals, "integral source")
    return Method(config, functional, backend, integrals)


def _named(registry: dict, key: str, given, what: str):
    try:
        return registry[key]
    except KeyError:
        raise ConfigError(f"unknown {what} {given!r}: choose one of {', '.join(sorted(registry))}") from None
