"""Nuclear gradients of a batch in flight: where they are computed, chosen by the integral source.

Two strategies behind one interface (:class:`GradientSource`), registered by name in
:data:`GRADIENT_SOURCES` (the integral source's ``gradients``):

- :class:`DeviceGradients`: bucket-shaped programs for the whole batch
  (:mod:`pyscf_ipu.device_forces`), dispatched right behind the SCF and its finalisation, reading
  their orbitals where they are: nothing per conformer on the host but reading the result.
- :class:`HostGradients`: conformer by conformer once the labels are read
  (:func:`pyscf_ipu.forces.nuclear_gradient`): libcint's derivative integrals and a program per
  molecule composition; the reference, and what a host preparation (libcint's integrals) needs.

Both include the grid's response: the exact derivative of the energy the SCF computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .device_forces import FITTED, GradientSettings, batch_gradients
from .forces import nuclear_gradient
from .integral_sources import bucket_inputs
from .method import Method
from .results import SCFResult
from .rks import BatchRun


class PendingGradients(Protocol):
    dispatch_seconds: float  # the wall time its dispatch took: on a CPU, where programs run as they are called, theirs

    def gradients(self, results: list[SCFResult | None]) -> list[np.ndarray | None]:
        """(natm, 3) dE/dR in Hartree/Bohr of each of the batch's first ``len(results)`` members, in
        its own atom order, given their labels; None where a result is None (not wanted)."""


class GradientSource(Protocol):
    name: str

    def dispatch(self, run: BatchRun, method: Method, wanted: Sequence[bool]) -> PendingGradients:
        """Start the gradients of ``run``'s conformers whose entry of ``wanted`` (one per batch member) is
        true (on the device, where the strategy can); the others (a filled batch's copies) get None, and
        the costliest of their work is skipped."""


@dataclass(frozen=True)
class _DevicePending:
    parts: list  # (C, natm_padded or more, 3) each, the gradient's terms by slot (a part may hold padding atoms)
    slots: list[np.ndarray]  # each member's slot of each of its atoms
    molecules: list  # each member's molecule; None where its gradient was not wanted (the device skipped it)
    method: Method
    dispatch_seconds: float = 0.0

    def gradients(self, results):
        parts = [np.asarray(part) for part in self.parts]
        dispersion, functional = self.method.dispersion, self.method.functional
        return [None if r is None or m is None
                else dispersion.gradient(m, functional, sum(part[c][slot] for part in parts))
                for c, (r, slot, m) in enumerate(zip(results, self.slots, self.molecules))]  # fmt: skip


@dataclass(frozen=True)
class DeviceGradients:
    """The batch's gradients as device programs per size bucket and batch width."""

    name: str = "device"

    def dispatch(self, run, method, wanted):
        final, batch = run.final, run.batch
        if final.mo_coeff is None:
            raise ValueError("device gradients need the finalisation's orbitals on the device (the JAX integrals)")
        start = time.perf_counter()
        molecules = [member.molecule for member in batch.members]
        elements, coords, placed = bucket_inputs(molecules, batch.bucket, method.needs_grid)
        present = frozenset(s for m in molecules for s in m.symbols)
        bucket = batch.bucket
        two_electron = FITTED if bucket.occupied else method.integrals.eri_dtype(method).name
        settings = GradientSettings(method.functional, method.needs_grid, two_electron, bucket)
        parts = batch_gradients(settings, elements, coords, present,
                                (final.mo_coeff, final.mo_energy, [m.nocc for m in batch.members]),
                                np.asarray(wanted, bool))  # fmt: skip
        slots = []
        for molecule, (_, atoms, *_) in zip(molecules, placed):
            slot = np.empty(molecule.natom, int)
            slot[atoms[atoms >= 0]] = np.flatnonzero(atoms >= 0)
            slots.append(slot)
        wanted_molecules = [m if w else None for m, w in zip(molecules, wanted)]
        return _DevicePending(parts, slots, wanted_molecules, method, time.perf_counter() - start)


@dataclass(frozen=True)
class _HostPending:
    molecules: list  # each member's molecule; None where its gradient was not wanted
    method: Method
    dispatch_seconds: float = 0.0  # its work is done when its gradients are asked for

    def gradients(self, results):
        return [None if r is None or m is None else nuclear_gradient(m, r, self.method, grid_response=True)
                for m, r in zip(self.molecules, results)]  # fmt: skip


@dataclass(frozen=True)
class HostGradients:
    """Conformer by conformer on the host, from each one's labels (libcint's derivative integrals)."""

    name: str = "host"

    def dispatch(self, run, method, wanted):
        return _HostPending([m.molecule if w else None for m, w in zip(run.batch.members, wanted)], method)


GRADIENT_SOURCES: dict[str, GradientSource] = {source.name: source for source in (DeviceGradients(), HostGradients())}


def gradient_source(method: Method) -> GradientSource:
    """The run's :class:`GradientSource`, as its integral source names it."""
    return GRADIENT_SOURCES[method.integrals.gradients]
