"""A batch's integrals, grid and guess as padded device arrays (:class:`BatchIntegrals`), and the device
programs that assemble them from a size bucket's template.

What the host sends for a batch of C conformers of one bucket is their atom positions and each
slot's element row (:meth:`~pyscf_ipu.buckets.SizeBucket.place`); the bucket's template layout and
element tables (:mod:`pyscf_ipu.templates`) are on the device already. One program then gathers each
conformer's basis values from the tables and evaluates, in float64, the one-electron integrals, the
Becke grid's weights, the nuclear repulsion and the superposition-of-atoms guess, and in the loop's
precision the AO values on the grid; the ERIs follow from the bucket's ERI plan
(:func:`device_eris`), or a density-fitted bucket's factor (:func:`device_factor`), in the precision
the integral source asks for: the loop reads them in its own, and the finalisation contracts them as
computed. Nothing of it depends on a
molecule's composition but data, so every molecule of the bucket runs these programs, and a batch
may mix them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .grid import AtomGrids, grid_coords_and_weights
from .integrals.ao_values import AOConstants, ao_kernel_in_blocks
from .integrals.eri import ShellValues, at_counts, chunk_batch, computed_counts, eri_s8, eri_structure, static_tables
from .integrals.eri_kernels import pair_program
from .integrals.fitting import (COMPANION_COEFFICIENT, FittingPlan, fitted_factor, fitting_kinds, fitting_structure,
                                plan_fitting)
from .integrals.one_electron import OneElectronLayout, layout_of, one_electron_matrices
from .molecule import Molecule
from .packed import FittedFactor, RangeSeparatedERIs, StreamedFactor, rectangular_order, triangle_side
from .programs import compiled, on_device
from .templates import BucketTemplate, ElementTables, SlotRows, long_range_one_centre_table

if TYPE_CHECKING:
    from .prepare import PreparedProblem


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class BatchIntegrals:
    """A batch's integrals, grid and guess, C conformers padded to their bucket's shapes (Np AOs, Gp
    grid points), on the device. Padded AOs (a template's absent slots, or those past a molecule's
    own) have zero rows and columns; padded grid points weigh nothing."""

    overlap: jax.Array  # (C, Np, Np) float64
    hcore: jax.Array  # (C, Np, Np) float64  T + V
    guess: jax.Array  # (C, Np, Np) float64  the initial density
    nuclear_repulsion: jax.Array  # (C,) float64
    weights: jax.Array  # (C, Gp) float64
    ao: jax.Array  # (C, 4, Gp, Np)  AO values and x/y/z derivatives, in the loop's precision
    real: jax.Array  # (C, Np) bool  the molecule's own AOs
    occupied: jax.Array  # (C,) int32  doubly occupied orbitals
    eris: jax.Array  # (C, s8 size of Np)  the ERIs as computed, PySCF's s8 packing; or the density-fitted
    # factor where the J-K backend fits (a packed.FittedFactor: (C, Qp, npair) in both precisions)


@dataclass(frozen=True, eq=False)
class BatchMember:
    """One conformer of a batch, as the host keeps it: its molecule, and where its own AOs are among
    the padded ones."""

    molecule: Molecule
    nocc: int
    aos: np.ndarray  # (N,) the padded row of each of the molecule's AOs, in its own AO order
    grid_points: int  # the molecule's own grid points (0 without a grid)
    host: PreparedProblem | None = None  # a host preparation's arrays (libcint), which its finalisation reads

    @property
    def nao(self) -> int:
        return len(self.aos)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TemplateLayout:
    """A template's layout as the assembly program reads it (device arrays)."""

    primitive_rows: SlotRows
    cartesian_rows: SlotRows
    shell_rows: SlotRows
    one_centre_rows: SlotRows
    ao_rows: SlotRows
    point_rows: SlotRows
    fitting_rows: SlotRows
    fitting_functions: jax.Array  # (Qp,) int  each fitting function's shell
    one_electron: OneElectronLayout
    cartesian_powers: jax.Array  # (Nc, 3) int
    cartesian_atom: jax.Array  # (Nc,) int
    cart2sph: jax.Array | None  # (Nc, Np) float64; None where the Cartesian AOs are the spherical ones
    eri_counts: tuple[int, int, int] = field(metadata={"static": True})  # the ERI programs' (computed_counts)


@lru_cache(maxsize=8)
def template_layout(template: BucketTemplate) -> TemplateLayout:
    """``template``'s :class:`TemplateLayout` on the device (once per template)."""
    cartesian = template.cartesian
    functions = np.repeat(np.arange(len(template.fitting_l)), 2 * template.fitting_l + 1).astype(np.int32)
    with jax.enable_x64(True):  # the transform stays float64
        return on_device(TemplateLayout(
            primitive_rows=template.primitive_rows, cartesian_rows=template.cartesian_rows,
            shell_rows=template.shell_rows, one_centre_rows=template.one_centre_rows, ao_rows=template.ao_rows,
            point_rows=template.point_rows, fitting_rows=template.fitting_rows, fitting_functions=functions,
            one_electron=layout_of(template.primitives), cartesian_powers=cartesian.powers,
            cartesian_atom=cartesian.atom, cart2sph=cartesian.cart2sph,
            eri_counts=computed_counts(template.plan)))  # fmt: skip


@lru_cache(maxsize=16)
def device_tables(template: BucketTemplate, present: frozenset[str]) -> ElementTables:
    """``template``'s element tables with the rows of ``present`` filled, on the device in float64."""
    with jax.enable_x64(True):
        return on_device(template.tables(present))


def _blocks(rows: SlotRows, table, elements):
    """(Np, Np): the block-diagonal matrix whose block of each slot is ``table`` (E, n, n) at its
    element's row, read at the places of the block's AOs ``rows``; zero between slots."""
    e = elements[rows.slot]  # (Np,)
    values = table[e[:, None], rows.local[:, None], rows.local[None, :]]
    return jnp.where(rows.slot[:, None] == rows.slot[None, :], values, 0.0)


def nuclear_repulsion(charges, coords):
    """sum_{A<B} Z_A Z_B / |R_A - R_B| over the atoms with charge (absent slots have none and may sit
    on top of another atom)."""
    pair = (charges[:, None] * charges[None, :] != 0) & ~jnp.eye(len(charges), dtype=bool)
    apart = coords[:, None, :] - coords[None, :, :]
    distance = jnp.sqrt(jnp.where(pair, jnp.sum(apart * apart, axis=-1), 1.0))
    return 0.5 * jnp.sum(jnp.where(pair, charges[:, None] * charges[None, :] / distance, 0.0))


def member_one_electron(layout: TemplateLayout, tables: ElementTables, elements, coords) -> dict[str, jax.Array]:
    """One conformer's {"overlap", "kinetic", "nuclear"} (Np, Np) matrices from its slots' element rows
    ``elements`` (natm,) and positions ``coords`` (natm, 3), in the positions' precision
    (:func:`~pyscf_ipu.integrals.one_electron.one_electron_matrices` on the template's layout)."""
    return one_electron_matrices(
        layout.one_electron,
        layout.primitive_rows.gather(tables.primitive_exponents, elements),
        layout.primitive_rows.gather(tables.primitive_coefficients, elements),
        tables.charges[elements],
        jnp.stack([_blocks(layout.ao_rows, tables.one_electron[:, k], elements) for k in range(3)]),
        coords,
    )


def member_fitting_shells(layout: TemplateLayout, tables: ElementTables, elements) -> tuple:
    """One conformer's fitting shells, then each atom's companion, as (exponents (S_f + natm, K),
    coefficients (S_f + natm, 1, K)), and which fitting functions are there (Qp,), from its slots'
    element rows ``elements`` (natm,)."""
    natm = len(elements)
    exponents = layout.fitting_rows.gather(tables.fitting_exponents, elements)  # (S_f, K)
    coefficients = layout.fitting_rows.gather(tables.fitting_coefficients, elements)
    k = exponents.shape[1]
    companion = jnp.zeros((natm, k), exponents.dtype).at[:, 0].set(COMPANION_COEFFICIENT)
    shells = (jnp.concatenate([exponents, jnp.zeros((natm, k), exponents.dtype)]),
              jnp.concatenate([coefficients, companion])[:, None, :])  # fmt: skip
    there = layout.fitting_rows.gather(tables.fitting_present, elements)  # (S_f,)
    return shells, there[layout.fitting_functions]


def _member(layout: TemplateLayout, tables: ElementTables, elements, coords, dtype: str, grid: bool) -> dict:
    """One conformer's integrals, grid weights, AO values, guess and ERI shell values (float64 but the
    AO values, in ``dtype``), from its slots' element rows ``elements`` (natm,)
    and positions ``coords`` (natm, 3)."""
    charges = tables.charges[elements]  # (natm,)
    ints = member_one_electron(layout, tables, elements, coords)
    out = {
        "overlap": ints["overlap"],
        "hcore": ints["kinetic"] + ints["nuclear"],
        "guess": _blocks(layout.ao_rows, tables.guess, elements),
        "nuclear_repulsion": nuclear_repulsion(charges, coords),
        "real": elements[layout.ao_rows.slot] != 0,
        "present": elements != 0,
        "shell_exponents": layout.shell_rows.gather(tables.shell_exponents, elements),
        "shell_coefficients": layout.shell_rows.gather(tables.shell_coefficients, elements),
        "one_centre": layout.one_centre_rows.gather(tables.one_centre_eris, elements),  # float64, as the ERIs
    }
    if len(layout.fitting_functions):  # density fitted
        out["fitting_shells"], out["fitting_present"] = member_fitting_shells(layout, tables, elements)
    if not grid:  # Hartree-Fock: no grid at all
        return {**out, "weights": jnp.zeros(0, coords.dtype)}
    points = layout.point_rows
    offsets = points.gather(tables.grid_offsets, elements)  # (Gp, 3) float64: each point minus its atom
    volumes = points.gather(tables.grid_volumes, elements)
    grids = AtomGrids(offsets, volumes, points.slot, tables.radii_adjust[elements[:, None], elements[None, :]],
                      elements != 0)  # fmt: skip
    _, weights = grid_coords_and_weights(grids, coords)
    cartesian = layout.cartesian_rows
    exponents = cartesian.gather(tables.cartesian_exponents, elements)  # (Nc, K)
    coefficients = cartesian.gather(tables.cartesian_coefficients, elements)
    constants = AOConstants(exponents, coefficients, -2.0 * exponents * coefficients, layout.cartesian_powers,
                            layout.cart2sph)._cast(lambda a: a.astype(dtype))  # fmt: skip
    # each atom's position minus each Cartesian AO's centre, in float64, then rounded once
    shifts = (coords[:, None, :] - coords[layout.cartesian_atom][None, :, :]).astype(dtype)  # (natm, Nc, 3)
    ao_inputs = (constants, offsets.astype(dtype), shifts, points.slot.astype(jnp.int32), volumes != 0)
    return {**out, "weights": weights, "ao_inputs": ao_inputs}


def _assemble(layout: TemplateLayout, tables: ElementTables, elements, coords, dtype: str, grid: bool) -> dict:
    """:func:`_member` over a batch, its ERI shell values extended to the counts the bucket's ERI
    programs compute (:func:`~pyscf_ipu.integrals.eri.at_counts`), which may be a wider bucket's."""
    out = jax.vmap(lambda e, c: _member(layout, tables, e, c, dtype, grid))(elements, coords)
    keys = ("shell_exponents", "shell_coefficients", "one_centre", "present")
    return {**out, **dict(zip(keys, at_counts(ShellValues(*(out[k] for k in keys)), layout.eri_counts)))}


assemble_program = compiled(_assemble, static_argnums=(4, 5), name="assemble", quick_compile=True)
# the AO values on their own, outside 64-bit mode: XLA's CPU code for the kernel's integer and
# float32 arithmetic is faster there (it is all float32)
ao_values_program = compiled(jax.vmap(ao_kernel_in_blocks), name="ao_values", quick_compile=True)


def assemble_integrals(template: BucketTemplate, elements: np.ndarray, coords: np.ndarray, occupied: np.ndarray,
                       present: frozenset[str], dtype, grid: bool, two_electron) -> BatchIntegrals:  # fmt: skip
    """The :class:`BatchIntegrals` of C conformers of ``template``'s bucket, from their slots' element
    rows ``elements`` (C, natm), positions ``coords`` (C, natm, 3) Bohr (absent slots anywhere) and
    doubly occupied orbital counts ``occupied`` (C,); ``present``: elements whose table rows are
    needed (a superset of the batch's), ``grid``: whether the functional needs one. The AO values
    in ``dtype``; the two-electron part from ``two_electron(template, coords, ERI shell values, the
    assembly program's outputs)``: the s8 ERIs (:func:`device_eris`) or a density-fitted bucket's
    factor (a :class:`~pyscf_ipu.packed.FittedFactor`). Dispatched, not waited for."""
    dtype = np.dtype(dtype).name
    with jax.enable_x64(True):
        out = assemble_program(template_layout(template), device_tables(template, present),
                               np.asarray(elements, np.int32), np.asarray(coords, np.float64), dtype, grid)  # fmt: skip
    if grid:
        ao = ao_values_program(*out["ao_inputs"])
    else:  # Hartree-Fock: no grid at all
        ao = on_device(np.zeros((len(coords), 4, 0, template.bucket.nao_padded), dtype))
    values = ShellValues(out["shell_exponents"], out["shell_coefficients"], out["one_centre"], out["present"])
    eris = two_electron(template, coords, values, out)
    return BatchIntegrals(overlap=out["overlap"], hcore=out["hcore"], guess=out["guess"],
                          nuclear_repulsion=out["nuclear_repulsion"], weights=out["weights"], ao=ao,
                          real=out["real"], occupied=on_device(np.asarray(occupied, np.int32)), eris=eris)  # fmt: skip


def device_eris(template: BucketTemplate, coords: np.ndarray, values: ShellValues, assembled: dict, dtype,
                threshold: float = 0.0) -> jax.Array:  # fmt: skip
    """The s8 ERIs (C, size) of a batch of ``template``'s bucket in ``dtype``, computed on the device
    under the bucket's ERI plan from the conformers' positions and the shells the assembly program
    gathered (``assembled`` is not read), Schwarz-screened at ``threshold`` (0: none)."""
    with jax.enable_x64(True):  # the shells and one-centre values arrive in float64
        return eri_s8(template.plan, coords, dtype, values=values, threshold=threshold)


def device_range_separated_eris(template: BucketTemplate, coords: np.ndarray, values: ShellValues, assembled: dict,
                                dtype, elements: np.ndarray, omega: float, threshold: float = 0.0
                                ) -> RangeSeparatedERIs:  # fmt: skip
    """:func:`device_eris` of a range-separated functional: the Coulomb ERIs and those of erf(ω r)/r,
    from the same shells, the long-range one-centre constants gathered on the host for the slots'
    element rows ``elements`` (C, natm) as the assembly program gathers the Coulomb ones; both
    Schwarz-screened at ``threshold``."""
    rows = template.one_centre_rows
    one_centre = long_range_one_centre_table(template, omega)[np.asarray(elements)[:, rows.slot], rows.local]  # (C, M)
    long_range = values._replace(one_centre=one_centre)
    with jax.enable_x64(True):  # the shells and one-centre values arrive in float64
        return RangeSeparatedERIs(eri_s8(template.plan, coords, dtype, values=values, threshold=threshold),
                                  eri_s8(template.plan, coords, dtype, values=long_range, omega=omega,
                                         threshold=threshold))  # fmt: skip


def device_factor(template: BucketTemplate, coords: np.ndarray, values: ShellValues, assembled: dict, dtype,
                  rank: int, omega: float = 0.0) -> FittedFactor | RangeSeparatedERIs:  # fmt: skip
    """The density-fitted factor of a batch of ``template``'s bucket, computed on the device in float64
    (:mod:`~pyscf_ipu.integrals.fitting`) from the conformers' positions and the shells the
    assembly program gathered, and rounded to ``dtype`` for the loop. ``omega`` > 0 (a range-separated
    functional's): that and the long-range erf(ω r)/r's factor (:class:`~pyscf_ipu.packed.RangeSeparatedERIs`),
    from the same pair data. A bucket that streams its factor gets the float64 one alone, reordered into
    the rectangular layout (:class:`~pyscf_ipu.packed.StreamedFactor`)."""
    plan = fitting_plan(template)
    with jax.enable_x64(True):
        data, shifts = pair_program(static_tables(template.plan)[0], eri_structure(template.plan),
                                    (values.exponents, values.coefficients), coords, values.present, "float64")
        fitting, _ = pair_program(fitting_kinds(plan), fitting_structure(plan), assembled["fitting_shells"], coords,
                                  values.present, "float64")
        factors = []
        for separation in (0.0, omega) if omega else (0.0,):
            exact, packed = fitted_factor(plan, data + fitting, shifts, assembled["fitting_present"], chunk_batch(),
                                          np.dtype(dtype).name, separation, bool(omega))  # fmt: skip
            if template.bucket.streams_factor:
                factors.append(StreamedFactor(rectangular_program(exact), rank))
            else:
                factors.append(FittedFactor(packed, exact, rank))
    return factors[0] if len(factors) == 1 else RangeSeparatedERIs(*factors)


@partial(compiled, name="rectangular_factor")
def rectangular_program(exact: jax.Array) -> jax.Array:
    """(C, Qp, npair): a batch's row-packed factors with their pairs in the rectangular layout
    (:func:`~pyscf_ipu.packed.rectangular_columns`)."""
    return jnp.take(exact, jnp.asarray(rectangular_order(triangle_side(exact.shape[-1]))), axis=-1)


@lru_cache(maxsize=4)
def fitting_plan(template: BucketTemplate) -> FittingPlan:
    """The :class:`~pyscf_ipu.integrals.fitting.FittingPlan` of ``template``'s fitting shells."""
    return plan_fitting(template.plan, template.fitting_rows.slot, template.fitting_l, template.fitting_primitives,
                        template.bucket.natm_padded)  # fmt: skip
