r"""Nuclear gradients of a whole batch as one device program per size bucket and batch width.

The gradient is the derivative of the Lagrangian at fixed density D and energy-weighted density W
(:mod:`pyscf_ipu.forces` gives the formula and the host's per-conformer path). Here every term is
differentiated, with ``jax.grad``, through the same bucket-shaped kernels that assemble the SCF's
integrals (:mod:`pyscf_ipu.assembly`): a conformer is its slots' element rows and positions, so one
compiled program serves every composition of the bucket, and the C conformers of a batch are one
call.

- **One-electron terms**, tr D (T + V) - tr W S, through the McMurchie-Davidson kernels
  (:func:`~pyscf_ipu.integrals.one_electron.one_electron_matrices`); their one-centre parts are
  geometry-independent constants and contribute nothing.
- **Nuclear repulsion**, through :func:`~pyscf_ipu.assembly.nuclear_repulsion`.
- **Exchange-correlation with grid response**: the points move with their atoms and the Becke
  weights are recomputed from the positions, so the result is the exact derivative of the energy as
  the SCF computed it (PySCF's ``grid_response = True``). The grid is walked a block of points at a
  time under ``jax.checkpoint``, so the backward pass holds one block's AO values.
- **Two-electron terms** of exact ERIs: the dot product of the bucket plan's s8 ERIs with their
  coefficients m_u (D_pq D_rs / 2 - a_x (D_pr D_qs + D_ps D_qr) / 8), the coefficients formed on
  the device from the packed index (:func:`eri_coefficients`), the ERIs differentiated in the
  integral source's precision. A density-fitted bucket's are not differentiated but computed: the
  derivative 3-centre and metric integrals contracted with their weights
  (:mod:`pyscf_ipu.integrals.fitting_gradient`), in float64, as the SCF's factor is.

D and W come from the finalisation's float64 orbitals on the device, so nothing returns to the
host between the SCF and the forces. Everything but the ERIs is float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .assembly import (device_tables, fitting_plan, member_fitting_shells, member_one_electron, nuclear_repulsion,
                       template_layout)
from .grid import AtomGrids, grid_coords_and_weights
from .integrals.ao_values import AOConstants, ao_kernel
from .integrals.eri import ShellValues, chunk_batch, eri_s8, eri_structure, static_tables
from .integrals.eri import device_tables as eri_device_tables
from .integrals.fitting import fitting_kinds, fitting_static, fitting_structure, plan_indices
from .integrals.fitting_gradient import FittedGradientPlan, fitted_gradient_member
from .numint import xc_energy
from .packed import traced_tril_unpack
from .programs import compiled
from .buckets import SizeBucket
from .templates import bucket_template
from .xc.functionals import Functional

FITTED = "fitted"  # the two-electron part of a density-fitted bucket, in float64 (else: the exact ERIs' precision)
FORCES_GRID_BLOCK = 2048  # grid points whose AO values (and their derivatives) the gradient holds at once
PADDING_OFFSET = 0.37  # Bohr along each axis from its atom: where a padding point of the grid sits


def orbital_densities(mo_coeff, mo_energy, occupied):
    """(D, W) (N, N) of one conformer: 2 C_occ C_occ^T and 2 C_occ diag(eps_occ) C_occ^T, the first
    ``occupied`` of the ascending orbitals ``mo_coeff`` (N, M), ``mo_energy`` (M,)."""
    mask = jnp.arange(mo_energy.shape[0]) < occupied
    c = jnp.where(mask[None, :], mo_coeff, 0.0)
    return 2.0 * c @ c.T, 2.0 * (c * jnp.where(mask, mo_energy, 0.0)) @ c.T


def eri_coefficients(dm, exchange: float, size: int, dtype):
    """(size,) d E_2e / d (u) for every s8-packed ERI u at the density ``dm`` (N, N), on the device:
    m_u (D_pq D_rs / 2 - a_x (D_pr D_qs + D_ps D_qr) / 8), m_u the number of distinct index
    permutations of u (:func:`pyscf_ipu.two_electron_gradient.two_electron_coefficients`, traced)."""
    u = jnp.arange(size, dtype=jnp.int64)
    ij, kl = traced_tril_unpack(u)
    (p, q), (r, s) = traced_tril_unpack(ij), traced_tril_unpack(kl)
    multiplicity = 8.0 / ((1.0 + (p == q)) * (1.0 + (r == s)) * (1.0 + (ij == kl)))
    coulomb = 0.5 * dm[p, q] * dm[r, s]
    exact = 0.125 * exchange * (dm[p, r] * dm[q, s] + dm[p, s] * dm[q, r])
    return (multiplicity * (coulomb - exact)).astype(dtype)


def _xc_energy(functional: Functional, layout, tables, elements, coords, dm):
    """E_xc of one conformer at the density ``dm`` (Np, Np) with its grid moving with the atoms
    ``coords`` (natm, 3), a block of :data:`FORCES_GRID_BLOCK` points at a time, each block's Becke
    weights and AO values recomputed in the backward pass (``jax.checkpoint``)."""
    rows = layout.point_rows
    volumes = rows.gather(tables.grid_volumes, elements)  # (Gp,) 0 on padding
    # each point minus its atom (Gp, 3); padding points moved off their atom's centre, where the
    # distance's derivative would be 0/0 (they weigh nothing either way)
    offsets = jnp.where((volumes != 0)[:, None], rows.gather(tables.grid_offsets, elements), PADDING_OFFSET)
    owners = jnp.asarray(rows.slot)
    count = -(-offsets.shape[0] // FORCES_GRID_BLOCK)
    pad = count * FORCES_GRID_BLOCK - offsets.shape[0]
    blocks = (jnp.pad(offsets, ((0, pad), (0, 0)), constant_values=PADDING_OFFSET).reshape(count, -1, 3),
              jnp.pad(volumes, (0, pad)).reshape(count, -1),
              jnp.pad(owners, (0, pad)).reshape(count, -1))  # fmt: skip
    adjust, present = tables.radii_adjust[elements[:, None], elements[None, :]], elements != 0
    cartesian = layout.cartesian_rows
    exponents = cartesian.gather(tables.cartesian_exponents, elements)  # (Nc, K)
    coefficients = cartesian.gather(tables.cartesian_coefficients, elements)
    constants = AOConstants(exponents, coefficients, -2.0 * exponents * coefficients, layout.cartesian_powers,
                            layout.cart2sph)  # fmt: skip

    @jax.checkpoint
    def block(total, chunk):
        offset, volume, owner = chunk
        _, weights = grid_coords_and_weights(AtomGrids(offset, volume, owner, adjust, present), coords)
        shifts = coords[:, None, :] - coords[layout.cartesian_atom][None, :, :]  # (natm, Nc, 3)
        ao = ao_kernel(constants, offset, shifts, owner, volume != 0)  # (4, B, Np)
        return total + xc_energy(functional, ao, weights, dm), None

    return jax.lax.scan(block, jnp.zeros((), coords.dtype), blocks)[0]


def _member_energy(functional: Functional, grid: bool, layout, tables, elements, coords, dm, weighted):
    """One conformer's Lagrangian less its two-electron part: tr D (T + V) - tr W S + V_NN + E_xc."""
    ints = member_one_electron(layout, tables, elements, coords)
    energy = jnp.sum(dm * (ints["kinetic"] + ints["nuclear"])) - jnp.sum(weighted * ints["overlap"])
    energy = energy + nuclear_repulsion(tables.charges[elements], coords)
    if grid and functional.pieces:
        energy = energy + _xc_energy(functional, layout, tables, elements, coords, dm)
    return energy


def _exact_two_electron(plan, tables, layout, elements, coords, dm, exchange: float, eri_dtype: str):
    """sum over the batch of the exact ERIs' energy, (C,) conformers at ``coords`` (C, natm, 3)."""
    values = _shell_values(layout, tables, elements)
    eris = eri_s8(plan, coords.astype(eri_dtype), eri_dtype, values=values)  # (C, size)
    weights = jax.vmap(lambda d: eri_coefficients(d, exchange, plan.size, eri_dtype))(dm)
    return jnp.sum(weights * eris)


def _shell_values(layout, tables, elements) -> ShellValues:
    return ShellValues(
        jax.vmap(lambda e: layout.shell_rows.gather(tables.shell_exponents, e))(elements),
        jax.vmap(lambda e: layout.shell_rows.gather(tables.shell_coefficients, e))(elements),
        jax.vmap(lambda e: layout.one_centre_rows.gather(tables.one_centre_eris, e))(elements),
        elements != 0,
    )


@dataclass(frozen=True)
class GradientSettings:
    """What the gradient program is compiled for besides its arrays' shapes."""

    functional: Functional
    grid: bool  # whether the functional has a part on the grid
    two_electron: str  # the exact ERIs' precision, or FITTED: a density-fitted bucket's
    bucket: SizeBucket


def _fitted_two_electron(settings: GradientSettings, layout, tables, structure, elements, coords, dm, orbitals):
    """(C, natm, 3) the density-fitted two-electron gradients of a batch, a conformer at a time
    (lax.map: each holds its 3-centre integrals), at densities ``dm`` (C, Np, Np) of ``orbitals``."""
    template = bucket_template(settings.bucket)
    plan = fitting_plan(template)
    kinds = (static_tables(template.plan)[0], fitting_kinds(plan))
    orbital_structure, fitting_arrays, indices = structure
    mo_coeff, _, occupied = orbitals
    columns = settings.bucket.occupied  # the bucket's bound on the occupied orbitals
    gradient_plan = FittedGradientPlan(fitting_static(plan), kinds, (orbital_structure, fitting_arrays), indices,
                                       chunk_batch())  # fmt: skip

    def member(args):
        element, position, density, coefficients, count = args
        orbital_shells = (layout.shell_rows.gather(tables.shell_exponents, element),
                          layout.shell_rows.gather(tables.shell_coefficients, element))  # fmt: skip
        fitting_shells, fitting_present = member_fitting_shells(layout, tables, element)
        occupied_orbitals = jnp.where(jnp.arange(columns) < count, coefficients[:, :columns], 0.0)  # (Np, O)
        exchange = settings.functional.hf_exchange
        return fitted_gradient_member(gradient_plan, (orbital_shells, fitting_shells), position, element != 0,
                                      fitting_present, density, occupied_orbitals, exchange)  # fmt: skip

    return jax.lax.map(member, (elements, coords, dm, mo_coeff, occupied))


def _batch_gradient(settings: GradientSettings, layout, tables, structure, elements, coords, orbitals):
    """(C, natm, 3) dE/dR of a batch from its finalisation's ``orbitals`` (coefficients (C, Np, Np),
    energies (C, Np), occupied counts (C,)); the kernel of :data:`gradient_program`. ``structure``:
    a density-fitted bucket's plan arrays (:func:`_fitted_structure`), else empty."""
    functional, two_electron = settings.functional, settings.two_electron
    template = bucket_template(settings.bucket)
    dm, weighted = jax.vmap(orbital_densities)(*orbitals)
    member_energy = partial(_member_energy, functional, settings.grid, layout, tables)

    def energy(coords):
        one = jnp.sum(jax.vmap(member_energy)(elements, coords, dm, weighted))
        if two_electron == FITTED:  # computed as a gradient below
            return one
        return one + _exact_two_electron(template.plan, tables, layout, elements, coords, dm, functional.hf_exchange,
                                         two_electron)  # fmt: skip

    gradient = jax.grad(energy)(coords)
    if two_electron == FITTED:
        gradient = gradient + _fitted_two_electron(settings, layout, tables, structure, elements, coords, dm, orbitals)
    return gradient


gradient_program = compiled(_batch_gradient, static_argnums=0, name="forces")


def _fitted_structure(template) -> tuple:
    """A density-fitted bucket's plan arrays on the device, made outside the trace (their caches must
    not keep a trace's values): the orbital and fitting pair stages' index arrays and the groups'
    destination parts."""
    plan = fitting_plan(template)
    return eri_structure(template.plan), fitting_structure(plan), plan_indices(plan)


def batch_gradients(settings: GradientSettings, elements, coords, present: frozenset[str], orbitals) -> jax.Array:
    """(C, natm_padded, 3) dE/dR in Hartree/Bohr, by slot, of C conformers of ``settings.bucket``
    (their slots' element rows ``elements`` (C, natm) and positions ``coords`` (C, natm, 3); the
    elements ``present`` among them) at the finalisation's ``orbitals``: coefficients (C, Np, Np),
    energies (C, Np) and occupied counts (C,). Dispatched, not waited for."""
    template = bucket_template(settings.bucket)
    mo_coeff, mo_energy, occupied = orbitals
    with jax.enable_x64(True):
        if settings.two_electron == FITTED:
            structure = _fitted_structure(template)
        else:
            structure = ()
            eri_device_tables(template.plan, 1)  # outside the trace: its caches must not keep a trace's values
        return gradient_program(settings, template_layout(template), device_tables(template, present), structure,
                                jnp.asarray(elements, jnp.int32), jnp.asarray(coords, jnp.float64),
                                (mo_coeff, mo_energy, jnp.asarray(occupied, jnp.int32)))  # fmt: skip
