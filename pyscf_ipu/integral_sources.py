"""Integral sources: where a batch's integrals, grid and guess come from.

Two strategies behind one interface (:class:`IntegralSource`), registered by name in
:data:`INTEGRAL_SOURCES` (``RKSConfig.integrals``; :func:`pyscf_ipu.resolution.resolve` picks one):
:class:`LibcintIntegrals` (PySCF's libcint on the host, float64, conformer by conformer: the
reference, :mod:`pyscf_ipu.prepare`) and :class:`JaxIntegrals` (the JAX kernels, assembled on the
device for a whole batch from its size bucket's template, :mod:`pyscf_ipu.assembly`). Both hand
over the batch as padded device arrays (:class:`~pyscf_ipu.assembly.BatchIntegrals`) and its
members as the host keeps them (:class:`~pyscf_ipu.assembly.BatchMember`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import jax
import numpy as np

from .assembly import (BatchIntegrals, BatchMember, assemble_integrals, device_eris, device_factor,
                       device_range_separated_eris, template_layout)
from .buckets import SizeBucket
from .molecule import Molecule
from .packed import FittedFactor, RangeSeparatedERIs, StreamedFactor, batch_eris, s8_size, to_rectangular, tril_unpack
from .padding import aligned_empty, pad_into, stack_padded
from .prepare import PreparedProblem, fitted_eri, prepare
from .programs import on_device
from .pyscf_mole import build_mole, placeholder_mole
from .strategies import IntegralSource
from .templates import bucket_template, element_data, element_grid



@lru_cache(maxsize=64)
def eri_plan(basis: str, elements: tuple[str, ...], omega: float = 0.0):
    """The ERI plan of ``basis`` on these atoms in this order (it does not depend on the geometry), of
    the Coulomb operator or (``omega`` > 0) the long-range erf(ω r)/r."""
    from .integrals.eri_plan import plan_eri

    return plan_eri(placeholder_mole(basis, elements), omega=omega)


def host_batch(hosts: list[PreparedProblem], dtype, shapes: tuple[int, int]) -> BatchIntegrals:
    """Host preparations (at each molecule's sizes, float64) as one padded batch on the device: the
    molecules' AOs first, padding after; the loop's arrays (AO values, ERIs) cast to ``dtype``."""
    npad, gpad = shapes
    dtype = np.dtype(dtype)
    ao = aligned_empty((len(hosts), 4, gpad, npad), dtype)
    for slot, host in zip(ao, hosts):
        pad_into(slot, host.ao)
    if hosts[0].eri_fitted.size:
        bucket = hosts[0].bucket
        factors = []
        for precision in (np.float64,) if bucket.streams_factor else (dtype, np.float64):
            factor = aligned_empty((len(hosts), bucket.naux_padded, npad * (npad + 1) // 2), precision)
            for slot, host in zip(factor, hosts):  # a molecule's pairs come first in the padded AOs' packing
                pad_into(slot, host.eri_fitted)
                if bucket.streams_factor:
                    to_rectangular(slot)
            with jax.enable_x64(True):
                factors.append(on_device(factor, may_alias=True))
        rank = bucket.occupied_rank
        eris = StreamedFactor(factors[0], rank) if bucket.streams_factor else FittedFactor(*factors, rank)
    else:
        eris = batch_eris([host.eri_s8 for host in hosts], npad, dtype)
    with jax.enable_x64(True):  # the float64 arrays stay float64
        return BatchIntegrals(
            overlap=stack_padded([h.overlap for h in hosts], np.float64, (npad, npad)),
            hcore=stack_padded([h.hcore for h in hosts], np.float64, (npad, npad)),
            guess=stack_padded([h.density_guess for h in hosts], np.float64, (npad, npad)),
            nuclear_repulsion=on_device(np.array([h.nuclear_repulsion for h in hosts])),
            weights=stack_padded([h.grid_weights for h in hosts], np.float64, (gpad,)),
            ao=on_device(ao, may_alias=True),  # new and never written again: the device may adopt it
            real=on_device(np.arange(npad)[None, :] < np.array([[h.nao] for h in hosts])),
            occupied=on_device(np.array([h.nocc for h in hosts], np.int32)),
            eris=eris,
        )


def host_integrals(hosts: list[PreparedProblem], method: Method, shapes: tuple[int, int] | None = None
                   ) -> tuple[BatchIntegrals, list[BatchMember], dict[str, float]]:  # fmt: skip
    """:meth:`IntegralSource.integrals` of conformers prepared on the host already (``hosts``), padded
    to their bucket's shapes or to ``shapes``."""
    start = time.perf_counter()
    npad, gpad = shapes or hosts[0].bucket.shapes
    if not method.needs_grid:  # Hartree-Fock: no grid, even where the hosts were prepared with one
        gpad = 0
        hosts = [replace(h, grid_coords=np.zeros((0, 3)), grid_weights=np.zeros(0), grid_owners=np.zeros(0, int),
                         ao=np.zeros((4, 0, h.nao))) for h in hosts]  # fmt: skip
    if npad < max(h.nao for h in hosts) or gpad < max(h.grid_points for h in hosts):
        raise ValueError(f"padded shapes {(npad, gpad)} are smaller than the batch's")
    integrals = host_batch(hosts, method.dtype, (npad, gpad))
    members = [BatchMember(h.molecule, h.nocc, np.arange(h.nao), h.grid_points, h) for h in hosts]
    return integrals, members, {"to_device": (time.perf_counter() - start) / len(hosts)}


@dataclass(frozen=True)
class LibcintIntegrals:
    """libcint through PySCF, in float64 on the host, conformer by conformer: the reference. A float32
    loop holds these integrals rounded, so the finalisation contracts the host's float64 ERIs."""

    name: str = "libcint"
    gradients: str = "host"  # a host preparation's labels are formed on the host: so are its gradients

    def integrals(self, molecules, bucket, method, shapes=None):
        start = time.perf_counter()
        hosts = prepare(molecules, method)
        integrals, members, timings = host_integrals(hosts, method, shapes)
        return integrals, members, {"prepare": (time.perf_counter() - start) / len(hosts) - timings["to_device"],
                                    **timings}  # fmt: skip

    def prepare_buckets(self, buckets, symbols):
        return None  # nothing is kept: every conformer is prepared from scratch

    eris_on_device: bool = False

    def fitting_bytes(self, bucket: SizeBucket) -> int:
        return 16  # fitted_eri solves in place, but each member's preparation keeps its factor

    def long_range(self, backend) -> bool:
        """Whether it makes the long-range integrals of a range-separated functional for ``backend``: not yet."""
        return False

    def eri_plan(self, basis, elements):
        return None

    def held_bytes(self, nao, grid_points, value_bytes):
        # float64, kept for the finalisation; AO values evaluated by PySCF on the host
        return {"eris": 8 * s8_size(nao), "ao_values": 8 * 4 * grid_points * nao}


@lru_cache(maxsize=4096)
def placement(bucket: SizeBucket, symbols: tuple[str, ...], grid: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Where a molecule of these ``symbols`` sits in ``bucket``'s template: (element row per slot,
    its atom per slot (-1: absent), the template AO of each of its AOs, its own grid points)."""
    rows, atoms = bucket.place(symbols)
    points = sum(len(element_grid(s, bucket.grid_level)[1]) for s in symbols) if grid else 0
    return rows, atoms, bucket_template(bucket).aos(atoms), points


def bucket_inputs(molecules: list[Molecule], bucket: SizeBucket, grid: bool) -> tuple[np.ndarray, np.ndarray, list]:
    """What the device reads of conformers ``molecules`` of ``bucket``: each slot's element row (C, natm),
    each slot's position (C, natm, 3) Bohr (absent slots at the origin), and each one's
    :func:`placement`."""
    placed = [placement(bucket, m.symbols, grid) for m in molecules]
    elements = np.stack([rows for rows, *_ in placed])
    # a zero row past each molecule's atoms: where its absent slots read their position
    coords = np.stack([np.concatenate([m.positions, np.zeros((1, 3))])[atoms] for m, (_, atoms, *_) in
                       zip(molecules, placed)])  # fmt: skip
    return elements, coords, placed


@dataclass(frozen=True)
class DeviceFactor:
    """A density-fitted run's factor from the JAX kernels, on the device, in float64
    (:func:`~pyscf_ipu.assembly.device_factor`)."""

    name: str = "jax"
    long_range: bool = True  # a range-separated functional's long-range factor: the same kernels, attenuated

    def fitting_bytes(self, bucket: SizeBucket) -> int:
        return 16  # the 3-centre integrals and the solve's output, both float64

    def factor(self, molecules, placed, bucket, method):
        """The ``factor`` argument of :func:`~pyscf_ipu.assembly.assemble_integrals` (with the long-range
        factor where the functional is range-separated)."""
        functional = method.functional
        omega = functional.omega if functional.range_separated else 0.0
        return partial(device_factor, dtype=method.dtype, rank=bucket.occupied_rank, omega=omega)


@dataclass(frozen=True)
class LibcintFactor:
    """A density-fitted run's factor from libcint on the host (:func:`~pyscf_ipu.prepare.fitted_eri`),
    conformer by conformer, placed in the template's pair order on the device: where the device is
    this CPU, libcint makes it faster than the device kernels, and with no program to compile.

    The host work starts on a thread of its own as soon as the batch asks for its factor, so that it
    runs beside the assembly programs (and, in a new process, beside their loading); libcint and the
    solve release Python's lock. The buffers are allocated on the calling thread, whose freed memory
    the next batch reuses (``docs/decisions/memory-reuse.md``), and libcint writes a molecule that
    fills its template straight into them."""

    name: str = "libcint"
    long_range: bool = True  # a range-separated functional's long-range factor: the same, attenuated

    def fitting_bytes(self, bucket: SizeBucket) -> int:
        # a molecule smaller than its template: its own factor before it is placed; libcint writes one
        # that fills it straight into the buffer
        return 0 if bucket.always_full else 8

    def factor(self, molecules, placed, bucket, method):
        """Each conformer's factor, and its long-range one (:class:`~pyscf_ipu.packed.RangeSeparatedERIs`)
        where the functional is range-separated."""
        functional = method.functional
        omegas = (0.0, functional.omega) if functional.range_separated else (0.0,)
        npad = bucket.nao_padded
        shape = (len(molecules), bucket.naux_padded, npad * (npad + 1) // 2)
        exacts = [aligned_empty(shape, np.float64, zeroed=True) for _ in omegas]
        # the loop's copies, unless the bucket streams its float64 factor
        loops = [] if bucket.streams_factor else [aligned_empty(shape, method.dtype, zeroed=True) for _ in omegas]

        def fill() -> None:
            for c, (molecule, (_, atoms, aos, _)) in enumerate(zip(molecules, placed)):
                ordered, aos = in_slot_order(molecule, atoms, aos)
                mol = build_mole(ordered, bucket.basis)
                pairs = template_pairs(aos)
                fills = len(pairs) == shape[2]  # every template pair, in order (aos ascend)
                for i, (omega, exact) in enumerate(zip(omegas, exacts)):
                    own = fitted_eri(mol, bucket.basis, method.config.eri_expcutoff, out=exact[c] if fills else None,
                                     omega=omega)  # fmt: skip
                    rows = len(own)
                    if not fills:  # the fitting functions' order is immaterial
                        copy_columns(exact[c, :rows], own, pairs)
                    if bucket.streams_factor:
                        to_rectangular(exact[c])
                    else:
                        loops[i][c, :rows] = exact[c, :rows]

        wait = in_background(fill, "libcint-factor")

        def made(template, coords, values, assembled) -> FittedFactor | StreamedFactor | RangeSeparatedERIs:
            wait()
            rank = bucket.occupied_rank
            with jax.enable_x64(True):
                if bucket.streams_factor:
                    factors = [StreamedFactor(on_device(exact, may_alias=True), rank) for exact in exacts]
                else:
                    factors = [FittedFactor(on_device(loop, may_alias=True), on_device(exact, may_alias=True), rank)
                               for exact, loop in zip(exacts, loops)]  # fmt: skip
            return factors[0] if len(factors) == 1 else RangeSeparatedERIs(*factors)

        return made


def in_background(work, name: str):
    """Start ``work()`` on a daemon thread (an interrupted run exits without waiting for it); returns a
    function that waits for its result and raises what it raised."""
    outcome = concurrent.futures.Future()

    def run() -> None:
        try:
            outcome.set_result(work())
        except BaseException as err:  # handed to the waiting thread
            outcome.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return outcome.result


def in_slot_order(molecule: Molecule, atoms: np.ndarray, aos: np.ndarray) -> tuple[Molecule, np.ndarray]:
    """``molecule`` with its atoms in the order of the template's slots they sit in (``atoms``: the
    molecule's atom per slot, -1 where absent), and the template AO of each of its AOs in that order
    (``aos``: the same in the molecule's own order; slots' AOs follow the slots, so in slot order they
    increase). A factor computed in slot order lands in long runs of the template's pairs, which copy
    as slices."""
    order = atoms[atoms >= 0]
    ordered = replace(molecule, atomic_numbers=molecule.atomic_numbers[order], positions=molecule.positions[order])
    return ordered, np.sort(aos)


def copy_columns(target: np.ndarray, source: np.ndarray, columns: np.ndarray) -> None:
    """``target[:, columns] = source``, run by run of consecutive ``columns`` (slice copies, where
    numpy's fancy indexing writes one element at a time)."""
    breaks = np.flatnonzero(np.diff(columns) != 1) + 1
    for start, stop in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(columns)]])):
        target[:, columns[start] : columns[start] + stop - start] = source[:, start:stop]


def template_pairs(aos: np.ndarray) -> np.ndarray:
    """(npair,) the padded AOs' packed pair (i >= j) of each of a molecule's own pairs, whose AOs sit
    at ``aos`` among the padded ones."""
    i, j = tril_unpack(np.arange(len(aos) * (len(aos) + 1) // 2))
    a, b = aos[i], aos[j]
    high, low = np.maximum(a, b), np.minimum(a, b)
    return high * (high + 1) // 2 + low


@dataclass(frozen=True)
class JaxIntegrals:
    """The JAX kernels of :mod:`pyscf_ipu.integrals`, assembled on the device for a whole batch
    (:mod:`pyscf_ipu.assembly`): the one-electron integrals, the grid and the guess in float64, the
    AO values in the SCF's precision, the ERIs in ``eri_precision`` (or the SCF's, if higher). The
    host sends the conformers' positions and element rows only. The loop reads the ERIs in its own
    precision, and the finalisation contracts them on the device as computed. A density-fitted run's
    factor comes from ``factor`` (:class:`DeviceFactor`, or :class:`LibcintFactor` where the device
    is this CPU).

    float64 ERIs give the labels of float64 integrals; float32 ones, much faster on a CPU, keep a
    small bias from the basis's data rounded to float32 (``docs/decisions/float64-finalisation.md``)."""

    name: str = "jax"
    factor: DeviceFactor | LibcintFactor = DeviceFactor()
    eri_precision: str = "float64"
    gradients: str = "device"  # the nuclear gradients' strategy (pyscf_ipu.gradients)

    def integrals(self, molecules, bucket, method, shapes=None):
        if shapes is not None and tuple(shapes) != bucket.shapes:
            raise ValueError("the JAX integrals take their size bucket's shapes")
        start = time.perf_counter()
        grid = method.needs_grid
        elements, coords, placed = bucket_inputs(molecules, bucket, grid)
        occupied = np.array([m.nelectron // 2 for m in molecules])
        present = frozenset(s for m in molecules for s in m.symbols)
        if bucket.occupied:  # density fitted: the factor, not the s8 ERIs
            two_electron = self.factor.factor(molecules, placed, bucket, method)
        else:
            dtype = self.eri_dtype(method)
            computed = {"dtype": dtype.name, "threshold": method.config.eri_screening(dtype)}
            if method.functional.range_separated:  # and the long-range ERIs
                two_electron = partial(device_range_separated_eris, elements=elements, omega=method.functional.omega,
                                       **computed)  # fmt: skip
            else:
                two_electron = partial(device_eris, **computed)
        integrals = assemble_integrals(bucket_template(bucket), elements, coords, occupied, present, method.dtype, grid,
                                       two_electron)  # fmt: skip
        members = [BatchMember(m, m.nelectron // 2, aos, points) for m, (_, _, aos, points) in zip(molecules, placed)]
        return integrals, members, {"assemble": (time.perf_counter() - start) / len(molecules)}

    def prepare_buckets(self, buckets, symbols):
        for bucket in buckets:
            template_layout(bucket_template(bucket))
            for symbol in set(symbols) & set(bucket.elements):
                element_data(bucket.basis, symbol)
                element_grid(symbol, bucket.grid_level)

    eris_on_device: bool = True

    def long_range(self, backend) -> bool:
        """Whether it makes the long-range integrals of a range-separated functional for ``backend``: the
        exact ERIs always, a density-fitted factor (its buckets follow the occupied orbitals) where its
        source can."""
        return self.factor.long_range if backend.occupied_step else True

    def eri_plan(self, basis, elements):
        return eri_plan(basis, tuple(elements))

    def eri_dtype(self, method: Method) -> np.dtype:
        """The precision the ERIs are computed in: ``eri_precision``, or the loop's where that is higher."""
        return np.promote_types(self.eri_precision, method.dtype)

    def fitting_bytes(self, bucket: SizeBucket) -> int:
        return self.factor.fitting_bytes(bucket)

    def held_bytes(self, nao, grid_points, value_bytes):
        # the bucket's s8 array as computed (the finalisation's), and rounded for the loop where that
        # is less precise; the AO values never leave the device
        computed = max(np.dtype(self.eri_precision).itemsize, value_bytes)
        return {"eris": (computed + (value_bytes if value_bytes < computed else 0)) * s8_size(nao), "ao_values": 0}


INTEGRAL_SOURCES: dict[str, IntegralSource] = {source.name: source for source in (LibcintIntegrals(), JaxIntegrals())}


def auto_integrals(platform: str) -> IntegralSource:
    """The ``auto`` integral source on a JAX ``platform``: the JAX integrals. Where the device is the
    CPU, with libcint's density-fitting factor (:class:`LibcintFactor`) and float32 ERIs, whose
    kernels are much faster there, and the nuclear gradients conformer by conformer on the host,
    twice as fast there as the batch's device program (``docs/decisions/device-forces.md``);
    elsewhere all on the device, the ERIs in float64 (``docs/decisions/float64-finalisation.md``)."""
    if platform == "cpu":
        return JaxIntegrals(factor=LibcintFactor(), eri_precision="float32", gradients="host")
    return JaxIntegrals(factor=DeviceFactor())
