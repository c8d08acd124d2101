r"""The density-fitted two-electron gradient on the device: the derivatives of the 3-centre integrals
and the metric, contracted with their weights as they are made.

With T_P,ij = (ij|P), M = (P|Q), the fitted density c = M^-1 T D and, for exact exchange,
X_P = C_occ^T (M^-1 T)_P C_occ (Weigend, Haser, Patzelt and Ahlrichs, Chem. Phys. Lett. 294, 143
(1998)):

.. math::

    \frac{dE_2}{dR} = \sum_{P,ij} T^R_{P,ij} G_{P,ij} + \sum_{PQ} M^R_{PQ} H_{PQ}, \qquad
    G_P = c_P D - 2 a_x C X_P C^T, \quad H_{PQ} = -\tfrac12 c_P c_Q + a_x \operatorname{tr} X_P X_Q.

The derivative integrals are the forward kernels' values of distributions one Hermite order up
(:func:`~.eri_kernels.pair_derivative_stage`): an orbital pair's product differentiated in its
first and its second centre; a fitting function (a pair with its companion) in its own, by the
shift of its Hermite matrix alone. The third centre of (ij|P), and the second of (P|Q), follow from
translation invariance: the integral does not change when every centre moves together. Each step's
values are contracted with the weights of their destinations at once and added to their atoms, so
no derivative tensor is ever held, and nothing is differentiated by ``jax.grad``: the program is the
forward stages' size, where differentiating them took minutes to compile
(``docs/decisions/device-forces.md``). Its short stages, those of high angular momenta, compute R by
whole-array recursions (:data:`COMPACT_CHUNKS`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..packed import traced_tril_unpack
from .eri_kernels import is_traced, pair_derivative_stage, pair_stage, raised
from .fitting import SquareKernel, fitted_integrals, groups_of, kept_eigen, scan_squares

# Pairs of groups of at most this many squares lay R out by whole-array recursions: the high angular
# momenta's few squares, whose unrolled kernels dominated the program's compile time
# (docs/decisions/device-forces.md)
COMPACT_CHUNKS = 256


def device_metric_solver(metric, omega):
    """x -> M^-1 x for the ``metric`` (Qp, Qp) of the operator of range separation ``omega`` (a number, or
    an array known at run time), as the SCF's factor solved it (:func:`~.fitting.factor_member`): by
    Cholesky, or, where the long-range metric has no Cholesky factor, by its pseudo-inverse over the
    eigenvalues kept by :func:`~.fitting.kept_eigen` (the Coulomb metric always has a Cholesky factor)."""
    lower = jnp.linalg.cholesky(metric)  # NaN where there is none
    cholesky = lambda x: jax.scipy.linalg.cho_solve((lower, True), x)  # noqa: E731
    if not is_traced(omega) and not omega:  # the Coulomb metric: positive definite
        return cholesky
    u, inverse = kept_eigen(metric)
    factored = jnp.all(jnp.isfinite(lower))
    pseudo = lambda x: u @ (inverse.reshape(-1, *(1,) * (x.ndim - 1)) * (u.T @ x))  # noqa: E731  (x: (Qp, ...))
    return lambda x: jnp.where(factored, cholesky(x), pseudo(x))


def _zero(weight) -> bool:
    """Whether ``weight`` is a Python zero: its term is left out of the program."""
    return not is_traced(weight) and not weight


def fitted_weights(three, metric, dm, occupied, pairs, operator):
    """(W (Qp, npair), H (Qp, Qp)): the weights of the 3-centre integrals ``three`` (Qp, npair), packed
    (G_P,ij counted twice off the diagonal), and of the ``metric`` (Qp, Qp), at the density ``dm``
    (N, N) of the ``occupied`` orbitals (N, O) (zero columns allowed); ``pairs``: the packed pairs'
    AOs (i, j), (npair,) each. ``operator``: (ω, Coulomb weight, exchange weight) of the integrals'
    operator in the energy (numbers, or arrays known at run time): c E_J + a E_K."""
    omega, coulomb, exchange = operator
    i, j = pairs
    twice = jnp.where(i == j, 1.0, 2.0)
    solve = device_metric_solver(metric, omega)
    weights, metric_weights = jnp.zeros_like(three), jnp.zeros_like(metric)
    if not _zero(coulomb):
        fitted = solve(three @ (dm[i, j] * twice))  # (Qp,)
        weights = coulomb * fitted[:, None] * dm[i, j][None, :]  # (Qp, npair)
        metric_weights = -0.5 * coulomb * fitted[:, None] * fitted[None, :]
    if not _zero(exchange):
        n = dm.shape[0]
        solved = solve(three)  # (Qp, npair) M^-1 T
        packed = jnp.zeros((n, n), jnp.int32).at[i, j].set(jnp.arange(len(i), dtype=jnp.int32))
        packed = jnp.maximum(packed, packed.T)  # (N, N) the packed index of (i, j) either way round
        x = jnp.einsum("ia,qij,jb->qab", occupied, solved[:, packed], occupied)  # (Qp, O, O)
        weights = weights - 2.0 * exchange * jnp.einsum("ia,qab,jb->qij", occupied, x, occupied)[:, i, j]
        flat = x.reshape(len(x), -1)
        metric_weights = metric_weights + exchange * flat @ flat.T
    return weights * twice[None, :], metric_weights


def _contract(weights, width: int, parts: int):
    """A :func:`~.fitting.scan_squares` consumer adding each step's derivative values, weighted by
    their destinations' ``weights`` (flat, column * ``width`` + row), to the atoms: the bra's ``parts``
    centres (values laid out (part, axis, function)), and minus their sum to the ket's."""
    index_dtype = jnp.int32 if weights.shape[0] < np.iinfo(np.int32).max else jnp.int64

    def add(gradient, values, rows, columns, valid, bra_atoms, ket_atoms):
        b, i, _, j, t = values.shape
        values = values.reshape(b, i, parts, 3, -1, j, t)
        rows, columns = rows.astype(index_dtype), columns.astype(index_dtype)
        destination = jnp.where(valid, columns[:, None, None, :, :] * width + rows[:, :, :, None, None], 0)
        weight = jnp.where(valid, jnp.take(weights, destination, mode="clip"), 0.0)  # (B, I, S, J, T)
        per = jnp.einsum("bipxsjt,bisjt->bipxj", values, weight)  # (B, I, parts, 3, J)
        for part in range(parts):
            gradient = gradient.at[bra_atoms[part]].add(per[:, :, part].sum(-1))
        return gradient.at[ket_atoms[0]].add(-per.sum((1, 2)).transpose(0, 2, 1))

    return add


def _stacked(moved):
    """(n, K2, 3 S, H+) Hermite matrices (n, K2, 3, S, H+) with the axis before the function."""
    return moved.reshape(*moved.shape[:2], -1, moved.shape[-1])


class FittedGradientPlan(NamedTuple):
    """What a size bucket's plans give the fitted gradient (the same for every conformer)."""

    static: tuple  # the fitting plan's compile-time part (:func:`~.fitting.fitting_static`)
    kinds: tuple  # the orbital and the fitting pair classes' (l_a, l_b, K_a, K_b)
    structure: tuple  # their pair stages' index arrays
    indices: tuple  # the groups' destination parts (:func:`~.fitting.plan_indices`)
    batch: int  # squares per step (:func:`~.eri.chunk_batch`)


def fitted_gradient_member(plan: FittedGradientPlan, shells, coords, present, fitting_present, dm, occupied,
                           operator):  # fmt: skip
    """(natm, 3) one conformer's density-fitted two-electron gradient dE_2/dR in float64.

    ``shells``: the orbital and the fitting shells ((S, K), (S, C', K)) each (the fitting ones
    followed by each atom's companion); ``coords`` (natm, 3) Bohr, ``present`` (natm,) the atoms
    there, ``fitting_present`` (Qp,) the fitting functions there; ``dm`` (N, N) and its ``occupied``
    orbitals (N, O); ``operator``: (ω, Coulomb weight, exchange weight) of the integrals' operator in
    the energy (:func:`fitted_weights`; numbers, or arrays known at run time, so that one program
    serves both operators of a range-separated functional; the plan's own ω is not read)."""
    static, kinds, structure, indices, batch = plan
    orbital_groups, fitting_groups, naux, npair, _ = static  # (fitting_static)
    omega = operator[0]
    orbital_kinds, fitting_kinds = kinds
    difference = coords[:, None, :] - coords[None, :, :]  # (natm, natm, 3)
    orbital = pair_stage(orbital_kinds, structure[0], shells[0], difference, present, coords.dtype)
    fitting = pair_stage(fitting_kinds, structure[1], shells[1], difference, present, coords.dtype)
    three, metric = fitted_integrals(static, indices, orbital + fitting, difference, fitting_present, batch, omega,
                                     COMPACT_CHUNKS)  # fmt: skip
    pairs = traced_tril_unpack(jnp.arange(npair))  # each packed pair's AOs (i, j), j <= i
    weights, metric_weights = fitted_weights(three, metric, dm, occupied, pairs, operator)
    # the derivatives' pair data, indexed as the forward data: the orbital classes', then the fitting ones'
    moved = tuple((_stacked(raised(max(la) + max(lb), e)), p, pa, atom)
                  for (la, lb, _, _), (e, p, pa, atom, _) in zip(fitting_kinds, fitting))  # fmt: skip
    derivatives = pair_derivative_stage(orbital_kinds, structure[0], shells[0], difference) + moved
    natm = coords.shape[0]
    derivative = SquareKernel(1, omega, COMPACT_CHUNKS)
    bra = groups_of(orbital_groups, indices[0], derivatives, atom_fields=2)
    ket = groups_of(fitting_groups, indices[1], orbital + fitting)
    gradient = scan_squares(bra, ket, difference, batch, jnp.zeros((natm, 3), coords.dtype),
                            _contract(weights.reshape(-1), npair, 2), derivative)  # fmt: skip
    bra = groups_of(fitting_groups, indices[1], derivatives)
    return scan_squares(bra, ket, difference, batch, gradient, _contract(metric_weights.reshape(-1), naux, 1),
                        derivative)  # fmt: skip
