"""A run's settings resolved into the objects that carry them out: :class:`Method`.

:func:`pyscf_ipu.resolution.resolve` makes it, the one place where the names in an
:class:`~pyscf_ipu.config.RKSConfig` become objects. Every stage (the preparation, the J-K
backends, the batched loop, the finalisation, the memory estimate, the generator) takes the
:class:`Method`; none of them looks a name up again. This module sits below all of them: it knows
the strategies by their interfaces (:mod:`pyscf_ipu.strategies`) only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .buckets import SizeBucket
from .config import RKSConfig
from .molecule import Molecule
from .pyscf_mole import check_basis
from .strategies import Dispersion, IntegralSource, JKBackend
from .xc.functionals import Functional


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
    bucket_step: int  # the size buckets' step for light kinds (RKSConfig.bucket_step, auto resolved by platform)
    dispersion: Dispersion  # the empirical dispersion added to the energy and forces
    memory_budget: float  # GB: the run's memory budget, which the J-K backend lays its arrays out for

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
        at the run's bucket step and the J-K backend's occupied-orbital step, in the layout the backend
        picks for it under the memory budget; :class:`~pyscf_ipu.molecule.MoleculeError` where the basis
        lacks an element."""
        config = self.config
        bucket = SizeBucket.of_symbols(symbols, config.basis, config.grid_level, self.backend.occupied_step, charge,
                                       self.bucket_step)  # fmt: skip
        return self.backend.laid_out(bucket, self)

    def check_elements(self, symbols) -> None:
        """:class:`~pyscf_ipu.molecule.MoleculeError`, before any work, where the basis or the dispersion
        correction cannot take one of the elements ``symbols``."""
        symbols = set(symbols)
        check_basis(symbols, self.config.basis)
        self.dispersion.check_elements(symbols)

    def same_bucket(self, molecules) -> SizeBucket:
        """The size bucket of ``molecules``, which must share one (a batch's); ValueError otherwise."""
        bucket = self.bucket(molecules[0])
        if any(self.bucket(molecule) != bucket for molecule in molecules[1:]):
            raise ValueError("a batch needs molecules of one size bucket")
        return bucket

    @property
    def loop(self) -> LoopSettings:
        config = self.config
        return LoopSettings(self.functional, self.backend, config.max_iterations, config.diis_space,
                            config.stop_threshold, config.convergence_std_ev)  # fmt: skip
