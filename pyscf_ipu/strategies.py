"""The interfaces of the run's strategy objects: what a J-K backend, an integral source and a
dispersion correction answer.

They sit below every stage that takes them, the resolved settings (:class:`~pyscf_ipu.method.Method`)
included, and name no stage above: the concrete strategies (:mod:`pyscf_ipu.jk`,
:mod:`pyscf_ipu.integral_sources`) and their resolution by name (:mod:`pyscf_ipu.resolution`) come
after. A ``method`` argument is the run's :class:`~pyscf_ipu.method.Method`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import jax.numpy as jnp
import numpy as np

from .buckets import SizeBucket
from .config import RKSConfig
from .molecule import Molecule
from .packed import PackedERI
from .xc.functionals import Functional


class JKBackend(Protocol):
    name: str
    occupied_step: int  # the size buckets' occupied-orbital step (0: none)
    profiles: bool  # whether ``profile`` reports how the work is spread (``--profile``)
    memory_advice: str  # what a memory error suggests first where not even one conformer fits

    def cpu_batch(self, bucket: SizeBucket) -> int:
        """Conformers per batch of ``bucket`` on a CPU, by default (``--batch-size auto``)."""

    def prepare(self, eris, nao_padded: int, dtype):
        """The batch's J-K arrays in ``dtype`` from its two-electron integrals ``eris`` as the integral
        source made them (s8 arrays (C, size) in any float precision, or a fitted factor), rounded to
        ``dtype`` inside the layout's own program: a separate cast would be one more program to compile."""

    def contract(self, data, dm: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        """(J, K) of one conformer's density ``dm`` from ``data``, what ``prepare`` made (its member); traced."""

    def profile(self, eri: PackedERI, nao_padded: int, dtype, iterations: int) -> dict | None:
        """A report of how the backend spreads the work (None if it has nothing to say)."""

    def layout_bytes(self, bucket: SizeBucket, value_bytes: int) -> int:
        """Peak bytes of ``prepare`` for one conformer of ``bucket`` (unscreened ERIs)."""

    def resident_bytes(self, bucket: SizeBucket, value_bytes: int) -> int:
        """Bytes of ``prepare``'s arrays for one conformer of ``bucket``, its temporaries gone."""

    def laid_out(self, bucket: SizeBucket, method) -> SizeBucket:
        """``bucket`` with the layout of its arrays that this backend picks under ``method`` (its memory
        budget): ``bucket`` itself where the backend has one layout."""

    def host_eris(self, mol, bucket: SizeBucket, config: RKSConfig) -> tuple[np.ndarray, int, np.ndarray]:
        """(s8 ERIs, their count kept, fitted factor) of one molecule from libcint, one of them empty."""

    def eri_bytes(self, bucket: SizeBucket, held: int, fitting_bytes: int, value_bytes: int) -> tuple[int, int]:
        """(held, made): host bytes of one conformer's integrals, and those held only while made."""

    def keeps_final_eris(self, method) -> bool:
        """Whether the batch's final inputs keep the ERIs as computed on the device for the finalisation."""

    def final_contraction(self, method):
        """The finalisation's :class:`~pyscf_ipu.finalisation.FinalContraction`."""

    def pyscf_counterpart(self, mf, basis: str):
        """PySCF's ``mf`` as it computes what the backend does."""

    def two_electron_gradient(self, mol, config: RKSConfig, occupied: np.ndarray, exchange: float,
                              omega: float = 0.0) -> np.ndarray:  # fmt: skip
        """(natm, 3) the derivative of the two-electron energy the backend computes (``omega`` > 0: of
        ``exchange`` times the exchange energy of erf(ω r)/r alone)."""


class IntegralSource(Protocol):
    """Where a batch's integrals and grid come from: one object per source, chosen by name
    (``RKSConfig.integrals``, resolved by :func:`pyscf_ipu.resolution.resolve`)."""

    name: str
    gradients: str  # where the batch's nuclear gradients are computed: a name in pyscf_ipu.gradients

    def integrals(self, molecules: list[Molecule], bucket: SizeBucket, method, shapes: tuple[int, int] | None = None
                  ) -> tuple:  # fmt: skip
        """(the batch's integrals on the device, a :class:`~pyscf_ipu.assembly.BatchIntegrals`, its
        members, :class:`~pyscf_ipu.assembly.BatchMember` each, and the host's seconds per conformer
        by stage) of conformers ``molecules`` of ``bucket`` under the run's
        :class:`~pyscf_ipu.method.Method`; ``shapes`` (Np, Gp) pads further than the bucket where
        the source can."""

    def long_range(self, backend: JKBackend) -> bool:
        """Whether it makes, for ``backend``, the long-range integrals a range-separated functional's
        exchange needs as well (then its batches' ERIs are :class:`~pyscf_ipu.packed.RangeSeparatedERIs`)."""

    def prepare_buckets(self, buckets, symbols) -> None:
        """Build, ahead of a run, what the source keeps per size bucket in ``buckets`` and per element
        in ``symbols`` (so that a run's first batches do not pay for it)."""

    eris_on_device: bool
    """Whether the source computes the ERIs on the device, where the float64 finalisation then
    contracts them as computed; else it contracts the host's float64 ERIs."""

    def eri_plan(self, basis: str, elements: tuple[str, ...]):
        """The ERI plan that spreads the integrals over tiles (for the IPU profile), or None."""

    def held_bytes(self, nao: int, grid_points: int, value_bytes: int) -> dict[str, int]:
        """What one conformer's preparation holds on the host: {"eris": bytes, "ao_values": bytes}
        for ``nao`` AOs and ``grid_points`` points, the loop in ``value_bytes`` floats."""

    def fitting_bytes(self, bucket: SizeBucket) -> int:
        """Bytes per value of a density-fitted factor of ``bucket`` that making it holds beside the factor
        itself (the float64 3-centre integrals, and the triangular solve's output where it is not in place)."""


class Dispersion(Protocol):
    """An empirical dispersion correction, from the geometry alone: one object per kind, chosen by name
    (``RKSConfig.dispersion``, resolved by :func:`pyscf_ipu.resolution.resolve`)."""

    name: str

    def energy_terms(self, molecule: Molecule, functional: Functional) -> dict[str, float]:
        """The terms (Hartree) the correction adds to ``molecule``'s energy, by name; none for no correction."""

    def gradient(self, molecule: Molecule, functional: Functional, gradient: np.ndarray) -> np.ndarray:
        """``gradient`` (natm, 3) (Hartree/Bohr) with the correction's gradient added."""

    in_pyscf: ClassVar[bool]
    """Whether PySCF can apply the same correction (:meth:`pyscf_counterpart`)."""

    def check(self, functional: Functional) -> None:
        """:class:`~pyscf_ipu.config.ConfigError` where the correction has no parameters for ``functional``."""

    def check_elements(self, symbols) -> None:
        """:class:`~pyscf_ipu.molecule.MoleculeError` where it has no parameters for one of ``symbols``."""

    def pyscf_counterpart(self, mf):
        """PySCF's mean-field object ``mf`` (not yet run) with the same correction."""
