"""The device-side SCF problem: host arrays padded to shared shapes and cast to the run's precision.

Padding rules (so that one compiled SCF loop serves every molecule in a shape bucket):

- grid points beyond G carry zero weight and zero AO values;
- AOs beyond N have zero integrals, zero AO values and unit overlap;
- columns of the orthogonaliser X beyond its M kept columns (padded AOs and projected-out linear
  dependencies alike) are zero, and the Fock matrix in the orthogonal basis gets
  :data:`VIRTUAL_SHIFT` on their diagonal. They become exactly decoupled empty orbitals far above
  the LUMO. The value is moderate on purpose: a float32 eigensolver's absolute error grows with the
  largest eigenvalue, so a huge shift (1e6) would ruin the real orbital energies.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from .integral_sources import conformer_coords
from .prepare import PreparedProblem
from .jk import JKBackend
from .packed import FittedERI, PackedERI, s8_size
from .padding import aligned_empty, pad_into, pad_to, stack_padded
from .programs import on_device

VIRTUAL_SHIFT = 10.0  # Hartree; above any real orbital energy of the supported bases


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SCFProblem:
    """Everything the jitted SCF loop reads, as arrays of padded shape (Np AOs, Gp grid points)."""

    hcore: jax.Array  # (Np, Np)
    overlap: jax.Array  # (Np, Np)
    orthogonaliser: jax.Array  # (Np, Np)  X, zero beyond the kept columns
    virtual_shift: jax.Array  # (Np,)  added to diag(X^T F X)
    density_guess: jax.Array  # (Np, Np)
    occupation: jax.Array  # (Np,)  2 for the nocc lowest orbitals, else 0
    nuclear_repulsion: jax.Array  # ()
    ao: jax.Array  # (4, Gp, Np)
    weights: jax.Array  # (Gp,)
    jk: dict  # the backend's arrays

    @property
    def shapes(self) -> tuple[int, int]:
        """(Np, Gp): the key under which compiled code is shared."""
        return self.hcore.shape[0], self.weights.shape[0]


def padded_shapes(prepared: PreparedProblem) -> tuple[int, int]:
    """(Np, Gp): the AO count and grid size of the problem's size bucket (see :mod:`pyscf_ipu.buckets`),
    Gp 0 without a grid (Hartree-Fock). Molecules of one bucket share every compiled program."""
    npad, gpad = prepared.bucket.shapes
    return npad, gpad if prepared.grid_points else 0


def device_ao_values(members: list[PreparedProblem], dtype, shapes: tuple[int, int]) -> jax.Array:
    """(C, 4, Gp, Np): the AO values of conformers whose host preparation left them to the device
    (``ao`` None, from :func:`~pyscf_ipu.integral_sources.device_grids`), evaluated by one program in ``dtype``,
    padded with zeros."""
    from .integrals.ao_values import ao_values

    coords = conformer_coords([h.mol for h in members], members[0].bucket)  # (C, natm, 3)
    offsets = [h.grid_coords - c[h.grid_owners] for h, c in zip(members, coords)]  # float64
    return ao_values([h.ao_tables for h in members], coords, offsets, [h.grid_owners for h in members], shapes, dtype)


def build_batch(members: list[PreparedProblem], backend: JKBackend, dtype, shapes: tuple[int, int] | None = None) -> SCFProblem:
    """The conformers ``members`` (molecules of one size bucket) as one problem with a leading batch
    axis, for the vmapped loop: each padded to the bucket's shapes and cast to ``dtype``, stacked.

    ``shapes`` defaults to the bucket's :func:`padded_shapes` (:func:`~pyscf_ipu.padding.fill_batch`
    pads the batch itself). AO values left to the device are evaluated there for the whole batch
    (:func:`device_ao_values`); host ones are cast and padded straight into their slot of the
    batch's array, in one pass. The J-K arrays come from the backend's ``prepare``, from every
    conformer's integrals as the bucket's s8 array (the molecule's leading, zeros after).
    """
    if len({h.bucket for h in members}) != 1:
        raise ValueError("a batch needs conformers of molecules of one size bucket")
    npad, gpad = shapes = shapes or padded_shapes(members[0])
    arrays = [_padded_arrays(h, shapes) for h in members]
    if len({h.ao is None for h in members}) != 1:
        raise ValueError("a batch needs one preparation: some conformers' AO values are on the host, some not")
    if members[0].ao is None:
        ao = device_ao_values(members, dtype, shapes)
    else:
        ao = aligned_empty((len(members), 4, gpad, npad), dtype)
        for slot, prepared in zip(ao, members):
            pad_into(slot, prepared.ao)
        ao = on_device(ao, may_alias=True)  # new and never written again: the device may adopt it
    return SCFProblem(
        **{k: stack_padded([np.asarray(a[k], dtype) for a in arrays]) for k in arrays[0]},
        ao=ao,
        jk=backend.prepare(backend_eris(members, npad), npad, dtype),
    )


def backend_eris(members: list[PreparedProblem], npad: int) -> list[PackedERI] | list[FittedERI]:
    """The conformers' ERIs as the J-K backend takes them: the density-fitted factors where the
    preparation made those, else each conformer's s8 array padded to ``npad`` AOs (the device's
    already are: no copy)."""
    if members[0].eri_fitted.size:
        bucket = members[0].bucket
        return [FittedERI(h.eri_fitted, h.nao, bucket.naux, bucket.occupied_rank) for h in members]
    return [PackedERI(h.eri_s8 if h.eri_nao == npad else pad_to(h.eri_s8, (s8_size(npad),)), npad, h.eri_kept)
            for h in members]  # fmt: skip


def _padded_arrays(prepared: PreparedProblem, shapes: tuple[int, int]) -> dict[str, np.ndarray]:
    """The problem's arrays but the AO values and the J-K data, padded to ``shapes``, in float64."""
    n, g = prepared.nao, prepared.grid_points
    npad, gpad = shapes
    if npad < n or gpad < g:
        raise ValueError(f"padded shapes {(npad, gpad)} are smaller than the problem's {(n, g)}")
    m = prepared.orthogonaliser.shape[1]
    return dict(
        hcore=pad_to(prepared.hcore, (npad, npad)),
        overlap=padded_overlap(prepared.overlap, npad),
        orthogonaliser=pad_to(prepared.orthogonaliser, (npad, npad)),
        virtual_shift=np.where(np.arange(npad) < m, 0.0, VIRTUAL_SHIFT),
        density_guess=pad_to(prepared.density_guess, (npad, npad)),
        occupation=np.where(np.arange(npad) < prepared.nocc, 2.0, 0.0),
        nuclear_repulsion=np.asarray(prepared.nuclear_repulsion),
        weights=pad_to(prepared.grid_weights, (gpad,)),
    )


def padded_overlap(overlap: np.ndarray, npad: int) -> np.ndarray:
    """The overlap matrix padded to (npad, npad), with a unit diagonal on the padded AOs."""
    n = overlap.shape[0]
    out = pad_to(overlap, (npad, npad))
    out[n:, n:] = np.eye(npad - n)
    return out
