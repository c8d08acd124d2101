r"""Nuclear gradients of a whole batch as device programs per size bucket and batch width.

The gradient is the derivative of the Lagrangian at fixed density D and energy-weighted density W
(:mod:`pyscf_ipu.forces` gives the formula and the host's per-conformer path), computed through the
same bucket-shaped kernels that assemble the SCF's integrals (:mod:`pyscf_ipu.assembly`): a conformer
is its slots' element rows and positions, so each compiled program serves every composition of the
bucket, and the C conformers of a batch are one call. Three programs, each a fraction of the whole's
compile time:

- **One-electron and nuclear terms** (``forces_one_electron``), tr D (T + V) - tr W S + V_NN,
  ``jax.grad`` through the McMurchie-Davidson kernels
  (:func:`~pyscf_ipu.integrals.one_electron.one_electron_matrices`) and
  :func:`~pyscf_ipu.assembly.nuclear_repulsion`; the one-centre parts are geometry-independent
  constants and contribute nothing.
- **Exchange-correlation with the grid's response** (``forces_xc``): the points move with their atoms
  and the Becke weights are recomputed from the positions, so the result is the exact derivative of
  the energy as the SCF computed it (PySCF's ``grid_response = True``). The grid is walked a block of
  points at a time under ``jax.checkpoint``, so the backward pass holds one block's AO values.
- **Two-electron terms** (``forces_two_electron``), not differentiated but computed as derivative
  integrals contracted with their weights, of each operator the functional has (the Coulomb
  operator's J and a K; a range-separated functional's long-range b K_ω too): exact ERIs in the
  integral source's precision (:mod:`pyscf_ipu.integrals.eri_gradient`), or a density-fitted
  bucket's 3-centre and metric integrals in float64, as its factor is
  (:mod:`pyscf_ipu.integrals.fitting_gradient`).

D and W come from the finalisation's float64 orbitals on the device, so nothing returns to the
host between the SCF and the forces. Everything but the exact ERIs is float64.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from .assembly import (device_tables, fitting_plan, member_fitting_shells, member_one_electron, nuclear_repulsion,
                       template_layout)
from .grid import FORCES_GRID_BLOCK, AtomGrids, grid_coords_and_weights
from .integrals.ao_values import AOConstants, ao_kernel
from .integrals.eri import (ShellValues, at_counts, chunk_batch, computed_counts, default_workers, eri_rows,
                            eri_shares, eri_structure, static_tables)
from .integrals.eri_gradient import eri_weights, exact_gradient_member
from .integrals.fitting import fitting_kinds, fitting_static, fitting_structure, plan_indices
from .integrals.fitting_gradient import FittedGradientPlan, fitted_gradient_member
from .numint import xc_energy
from .programs import compiled
from .buckets import SizeBucket
from .templates import bucket_template, eri_bucket
from .xc.functionals import Functional

FITTED = "fitted"  # the two-electron part of a density-fitted bucket, in float64 (else: the exact ERIs' precision)
PADDING_OFFSET = 0.37  # Bohr along each axis from its atom: where a padding point of the grid sits


def orbital_densities(mo_coeff, mo_energy, occupied):
    """(D, W) (N, N) of one conformer: 2 C_occ C_occ^T and 2 C_occ diag(eps_occ) C_occ^T, the first
    ``occupied`` of the ascending orbitals ``mo_coeff`` (N, M), ``mo_energy`` (M,)."""
    mask = jnp.arange(mo_energy.shape[0]) < occupied
    c = jnp.where(mask[None, :], mo_coeff, 0.0)
    return 2.0 * c @ c.T, 2.0 * (c * jnp.where(mask, mo_energy, 0.0)) @ c.T


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


def _one_electron_energy(layout, tables, elements, coords, dm, weighted):
    """One conformer's one-electron and nuclear terms of the Lagrangian: tr D (T + V) - tr W S + V_NN."""
    ints = member_one_electron(layout, tables, elements, coords)
    energy = jnp.sum(dm * (ints["kinetic"] + ints["nuclear"])) - jnp.sum(weighted * ints["overlap"])
    return energy + nuclear_repulsion(tables.charges[elements], coords)


def _summed_over(operator, terms: tuple, dtype):
    """The sum of ``operator(term)`` over the functional's two-electron operators ``terms`` (ω, Coulomb
    weight, exchange weight): one operator's numbers traced in as they are; two, a range-separated
    functional's, as a map over their values, so that one kernel serves both."""
    if len(terms) == 1:
        return operator(terms[0])
    return jax.lax.map(operator, jnp.asarray(terms, dtype)).sum(0)


def _map_wanted(member, args, wanted):
    """``member`` of each conformer of ``args`` (leading axis C), a conformer at a time (lax.map), and
    zeros for those not ``wanted`` (C,) bool: a filled batch's copies are branched around, not
    computed."""

    def one(both):
        values, want = both
        shape = jax.eval_shape(member, values)
        zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)  # noqa: E731
        return jax.lax.cond(want, member, zeros, values)

    return jax.lax.map(one, (args, wanted))


def _exact_two_electron(operators: tuple, arrays, shells, coords, dm, wanted):
    """(C, natm_computed, 3) the exact-ERI two-electron gradients of a batch, a conformer at a time, from
    the derivative ERIs (:mod:`~pyscf_ipu.integrals.eri_gradient`) of each of the ``operators``
    (:func:`operators`: the plan's static tables, and per operator its (ω, Coulomb weight, exchange
    weight); two operators, a range-separated functional's, run as one kernel over both), in the
    precision of ``coords``. Every array has the shapes of the bucket's ERI programs (:func:`_eri_inputs`),
    so that buckets that share those share this program too: the plan's ``arrays`` (its quartet
    classes, rows' tables and pair stage's index arrays), the conformers' ``shells`` (exponents,
    coefficients, the atoms there), positions ``coords`` and densities ``dm``; zeros where not
    ``wanted`` (C,)."""
    static, terms = operators

    def member(args):
        exponents, coefficients, present, position, density = args

        def operator(term):
            omega, coulomb, exchange = term
            weights = eri_weights(density, coulomb, exchange, static[2], position.dtype)
            return exact_gradient_member(static, arrays, (exponents, coefficients), position, present, weights, omega)

        return _summed_over(operator, terms, position.dtype)

    return _map_wanted(member, (*shells, coords, dm), wanted)


def _eri_inputs(settings: GradientSettings, layout, tables, elements, coords, dm):
    """What :func:`_exact_two_electron` reads of a batch, in the shapes of the bucket's ERI programs
    (those of :func:`~pyscf_ipu.templates.eri_bucket`, which buckets that differ only in hydrogens
    share): the shells (exponents, coefficients, the atoms there) at the plan's counts, the positions
    in the ERIs' precision and the densities, padded."""
    plan = bucket_template(settings.bucket).plan
    values = jax.vmap(lambda e: (layout.shell_rows.gather(tables.shell_exponents, e),
                                 layout.shell_rows.gather(tables.shell_coefficients, e)))(elements)  # fmt: skip
    exponents, coefficients, _, present = at_counts(ShellValues(*values, jnp.zeros((len(elements), 0)), elements != 0),
                                                    computed_counts(plan))  # fmt: skip
    coords = jnp.pad(coords, [(0, 0), (0, plan.padded_natm - coords.shape[1]), (0, 0)])
    extra = eri_bucket(settings.bucket).nao_padded - dm.shape[-1]
    dm = jnp.pad(dm, [(0, 0), (0, extra), (0, extra)])
    return (exponents, coefficients, present), coords.astype(settings.two_electron), dm


@dataclass(frozen=True)
class GradientSettings:
    """What the gradient programs are compiled for besides their arrays' shapes."""

    functional: Functional
    grid: bool  # whether the functional has a part on the grid
    two_electron: str  # the exact ERIs' precision, or FITTED: a density-fitted bucket's
    bucket: SizeBucket


def _fitted_gradient(settings: GradientSettings, layout, tables, structure, elements, coords, orbitals, wanted):
    """(C, natm, 3) the density-fitted two-electron gradients of a batch, a conformer at a time
    (lax.map: each holds its 3-centre integrals), at the densities of its finalisation's ``orbitals``,
    from the bucket's plan arrays ``structure`` (:func:`_fitted_structure`); zeros where not ``wanted``."""
    dm, _ = jax.vmap(orbital_densities)(*orbitals)
    template = bucket_template(settings.bucket)
    plan = fitting_plan(template)
    kinds = (static_tables(template.plan)[0], fitting_kinds(plan))
    orbital_structure, fitting_arrays, indices = structure
    mo_coeff, _, occupied = orbitals
    columns = settings.bucket.occupied  # the bucket's bound on the occupied orbitals
    gradient_plan = FittedGradientPlan(fitting_static(plan), kinds, (orbital_structure, fitting_arrays), indices,
                                       chunk_batch())  # fmt: skip
    terms = functional_operators(settings.functional)

    def member(args):
        element, position, density, coefficients, count = args
        orbital_shells = (layout.shell_rows.gather(tables.shell_exponents, element),
                          layout.shell_rows.gather(tables.shell_coefficients, element))  # fmt: skip
        fitting_shells, fitting_present = member_fitting_shells(layout, tables, element)
        occupied_orbitals = jnp.where(jnp.arange(columns) < count, coefficients[:, :columns], 0.0)  # (Np, O)

        def operator(term):
            return fitted_gradient_member(gradient_plan, (orbital_shells, fitting_shells), position, element != 0,
                                          fitting_present, density, occupied_orbitals, term)  # fmt: skip

        return _summed_over(operator, terms, position.dtype)

    return _map_wanted(member, (elements, coords, dm, mo_coeff, occupied), wanted)


def _one_electron_gradient(settings: GradientSettings, layout, tables, elements, coords, orbitals):
    """The one-electron and nuclear terms' gradients of a batch (``jax.grad``), (C, natm, 3), from its
    finalisation's ``orbitals`` (coefficients (C, Np, Np), energies (C, Np), occupied counts (C,));
    and, for an exact-ERI bucket, its :func:`_eri_inputs` (else empty)."""
    dm, weighted = jax.vmap(orbital_densities)(*orbitals)
    energy = lambda coords: jnp.sum(jax.vmap(partial(_one_electron_energy, layout, tables))(elements, coords, dm,
                                                                                           weighted))  # noqa: E731
    inputs = () if settings.two_electron == FITTED else _eri_inputs(settings, layout, tables, elements, coords, dm)
    return jax.grad(energy)(coords), inputs


def _xc_gradient(functional: Functional, layout, tables, elements, coords, orbitals):
    """(C, natm, 3) the exchange-correlation energy's gradients of a batch with the grid's response
    (``jax.grad`` through :func:`_xc_energy`), at the densities of ``orbitals``."""
    dm, _ = jax.vmap(orbital_densities)(*orbitals)
    energy = lambda coords: jnp.sum(jax.vmap(partial(_xc_energy, functional, layout, tables))(elements, coords,
                                                                                             dm))  # noqa: E731
    return jax.grad(energy)(coords)


# Programs apart, not one: each compiles in a fraction of the whole's time, the exact ERIs' is shared
# by the buckets that share their ERI programs, and the run's report names each one's compile and run
# seconds. XLA's quicker CPU emitters: each runs once per batch.
one_electron_program = compiled(_one_electron_gradient, static_argnums=0, name="forces_one_electron",
                                quick_compile=True)  # fmt: skip
xc_program = compiled(_xc_gradient, static_argnums=0, name="forces_xc", quick_compile=True)
exact_program = compiled(_exact_two_electron, static_argnums=0, name="forces_two_electron", quick_compile=True)
fitted_program = compiled(_fitted_gradient, static_argnums=0, name="forces_fitted", quick_compile=True)


def _fitted_structure(template) -> tuple:
    """A density-fitted bucket's plan arrays on the device, made outside the trace (their caches must
    not keep a trace's values): the orbital and fitting pair stages' index arrays and the groups'
    destination parts."""
    plan = fitting_plan(template)
    return eri_structure(template.plan), fitting_structure(plan), plan_indices(plan)


def _exact_structure(plan) -> tuple:
    """An exact-ERI bucket's plan arrays on the device, made outside the trace: its quartet classes (one
    share of them), its rows' tables and its pair stage's index arrays."""
    return eri_shares(plan, 1)[0][2], eri_rows(plan), eri_structure(plan)


def operators(functional: Functional, plan) -> tuple:
    """The two-electron operators of ``functional`` on the ERI ``plan``: the plan's
    :func:`~pyscf_ipu.integrals.eri.static_tables`, and per operator (ω, its Coulomb weight, its
    exchange weight): 1/r with J and a K, and for a range-separated functional erf(ω r)/r with b K_ω."""
    return static_tables(plan, 0.0), functional_operators(functional)


def functional_operators(functional: Functional) -> tuple:
    """(ω, Coulomb weight, exchange weight) of each two-electron operator of ``functional``'s energy."""
    coulomb = ((0.0, 1.0, functional.hf_exchange),)
    if not functional.range_separated:
        return coulomb
    return coulomb + ((functional.omega, 0.0, functional.long_range_exchange),)


def batch_gradients(settings: GradientSettings, elements, coords, present: frozenset[str], orbitals, wanted) -> list:
    """The parts of dE/dR in Hartree/Bohr, (C, natm_padded or more, 3) each by slot (the exact ERIs' also
    the ERI programs' padding atoms), whose sum over the bucket's slots is the gradient, of C conformers of ``settings.bucket`` (their slots' element rows ``elements`` (C, natm) and
    positions ``coords`` (C, natm, 3); the elements ``present`` among them) at the finalisation's
    ``orbitals``: coefficients (C, Np, Np), energies (C, Np) and occupied counts (C,). The two-electron
    part, the costliest, skips the conformers not ``wanted`` (C,) bool (a filled batch's copies).

    On an accelerator the programs are dispatched, not waited for. On a CPU, where a program runs on
    the calling thread, the two-electron and exchange-correlation programs run on a thread each."""
    template = bucket_template(settings.bucket)
    mo_coeff, mo_energy, occupied = orbitals
    with jax.enable_x64(True):
        layout, tables = template_layout(template), device_tables(template, present)
        elements, coords = jnp.asarray(elements, jnp.int32), jnp.asarray(coords, jnp.float64)
        wanted = jnp.asarray(wanted, bool)
        orbitals = (mo_coeff, mo_energy, jnp.asarray(occupied, jnp.int32))
        one_electron, inputs = one_electron_program(settings, layout, tables, elements, coords, orbitals)
        if settings.two_electron == FITTED:
            structure = _fitted_structure(template)
            two_electron = partial(fitted_program, settings, layout, tables, structure, elements, coords, orbitals,
                                   wanted)  # fmt: skip
        else:
            arrays = _exact_structure(template.plan)
            two_electron = partial(exact_program, operators(settings.functional, template.plan), arrays, *inputs,
                                   wanted)  # fmt: skip
    parts = [two_electron]
    if settings.grid and settings.functional.pieces:
        parts.append(partial(xc_program, settings.functional, layout, tables, elements, coords, orbitals))

    def run(part):
        with jax.enable_x64(True):  # worker threads do not inherit the caller's context
            return part()

    if default_workers() == 1:
        return [one_electron, *(run(part) for part in parts)]
    with ThreadPoolExecutor(len(parts)) as pool:
        return [one_electron, *pool.map(run, parts)]
