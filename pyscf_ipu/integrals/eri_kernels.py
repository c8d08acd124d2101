r"""The ERI kernels: the values of an :mod:`.eri_plan`'s quartet chunks, by McMurchie-Davidson, in JAX.

For primitive Gaussians with product centres P (exponents a + b = p) and Q (c + d = q),

.. math::

    (ab|cd) = \frac{2\pi^{5/2}}{pq\sqrt{p+q}} \sum_{tuv} E^{ab}_{tuv}
              \sum_{\tau\nu\phi} (-1)^{\tau+\nu+\phi} E^{cd}_{\tau\nu\phi}\,
              R_{t+\tau,u+\nu,v+\phi}(\alpha, \mathbf{R}_{PQ}), \qquad \alpha = \frac{pq}{p+q},

with the Hermite expansion coefficients E (products of the per-axis E^{ij}_t) and the Hermite
Coulomb integrals R of :mod:`.hermite` (McMurchie and Davidson, J. Comput. Phys. 26, 218 (1978);
Helgaker, Jorgensen and Olsen, *Molecular Electronic-Structure Theory*, 9.9).

Two programs: the **pair stage** forms, per shell pair and primitive pair, the Hermite matrix E
(spherical AO pair, t u v) with the contraction coefficients and the Cartesian-to-spherical
transform folded in; the **quartet stage** runs one kernel per quartet class over its chunks
(``lax.map``, so memory stays bounded), each chunk three matmuls and flat elementwise loops laid out
for XLA's CPU backend, and scatters the values into the s8 array. Chunks with nothing to compute
(the padding of a size bucket's chunk grid) are skipped at run time.

Geometry enters through differences: A - C between atoms from a float64 host table, and P - A =
-(b/p)(A - B), so a quartet on one atom sees exactly zero displacements in float32 as well.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from ..programs import MappingBudget, compiled, map_members
from .basis import cartesian_powers
from .boys import scaled
from .eri_plan import CHUNK, NOWHERE, cartesian_functions, cartesian_to_spherical
from .hermite import (PairFactors, hermite_coefficients, hermite_coulomb, hermite_coulomb_stacked, hermite_indices,
                      stack_hermite)


@lru_cache(maxsize=None)
def _hermite_gather(la: tuple[int, ...], lb: tuple[int, ...]):
    """Index arrays (3 axes) of shape (C_a C_b, H) into a stacked E table (i, j, t), for the Hermite matrix."""
    hermite = hermite_indices(max(la) + max(lb))
    rows = [(pa, pb) for pa in cartesian_functions(la) for pb in cartesian_functions(lb)]
    return tuple(
        (np.array([[pa[axis] for _ in hermite] for pa, _ in rows], np.int32),
         np.array([[pb[axis] for _ in hermite] for _, pb in rows], np.int32),
         np.array([[h[axis] for h in hermite] for _ in rows], np.int32))
        for axis in range(3)
    )  # fmt: skip


GATHERED_ORDER = 9  # classes above (dd|dd)'s Hermite order 8 gather R (f shells: docs/decisions/f-shells.md)


@lru_cache(maxsize=None)
def _coulomb_pairs(bra_order: int, ket_order: int) -> np.ndarray:
    """(H_ket, H_bra): the position among R's Hermite indices of h + g, for ket index g and bra index h."""
    position = {h: n for n, h in enumerate(hermite_indices(bra_order + ket_order))}
    return np.array([[position[(h[0] + g[0], h[1] + g[1], h[2] + g[2])] for h in hermite_indices(bra_order)]
                     for g in hermite_indices(ket_order)], np.int32)  # fmt: skip


def pair_factors(exponents, coefficients, first, second, kind):
    """(PairFactors, p, c_a c_b / p) of the primitive pairs of the shell pairs (``first``, ``second``)
    (n,) of one class ``kind`` = (l_a, l_b, K_a, K_b): (n, K2) each but the last, (n, K2, C_a C_b)
    with the coefficients of each pair of Cartesian functions. ``exponents`` (S, K) and
    ``coefficients`` (S, C, K) are the shells' (:class:`~.eri_plan.Shells`), numpy or JAX (traced
    in the ERI programs, in float64 from host positions)."""
    la, lb, ka, kb = kind
    n = first.shape[0]
    a, b = exponents[first, :ka, None], exponents[second, None, :kb]  # (n, ka, 1), (n, 1, kb)
    p = a + b
    flat = lambda x: jnp.broadcast_to(x, (n, ka, kb)).reshape(n, -1)  # noqa: E731

    def cartesian(shell, components, k):  # (n, K, C): each Cartesian function's coefficients, by component
        return jnp.concatenate([jnp.repeat(coefficients[shell, m, :k, None], len(cartesian_powers(l)), axis=2)
                                for m, l in enumerate(components)], 2)  # fmt: skip

    ca, cb = cartesian(first, la, ka), cartesian(second, lb, kb)
    coef = ca[:, :, None, :, None] * cb[:, None, :, None, :] / p[..., None, None]  # (n, ka, kb, C_a, C_b)
    return PairFactors(*(flat(x) for x in (0.5 / p, a / p, b / p, a * b / p))), flat(p), coef.reshape(n, ka * kb, -1)


def _pair_data(la, lb, factors: PairFactors, p, scale, ab):
    """Per shell pair and primitive pair: the Hermite matrix (n, K2, S_a S_b, H) with the coefficients,
    1/p and the spherical transform folded in; P - A as (3, n, K2)."""
    n, k2 = p.shape
    top_a, top_b = max(la), max(lb)
    e = None
    for axis, (i, j, t) in enumerate(_hermite_gather(la, lb)):
        table = hermite_coefficients(top_a, top_b, factors, ab[:, None, axis])
        factor = stack_hermite(table, top_a, top_b, top_a + top_b)[:, :, i, j, t]  # (n, K2, C_a C_b, H)
        e = factor if e is None else e * factor
    e = e * scale[:, :, :, None]
    h = e.shape[-1]
    sa, sb = cartesian_to_spherical(la), cartesian_to_spherical(lb)
    e = e.reshape(n, k2, sa.shape[0], sb.shape[0], h)
    e = jnp.einsum("nkabh,as,bt->nksth", e, jnp.asarray(sa, e.dtype), jnp.asarray(sb, e.dtype))
    pa = -factors.b_frac[None] * ab.T[:, :, None]  # (3, n, K2)
    return e.reshape(n, k2, -1, h), pa


@lru_cache(maxsize=None)
def _lowered(order: int) -> tuple[np.ndarray, np.ndarray]:
    """(3, H+) for the Hermite indices of ``order`` + 1, per axis: the position among those of
    ``order`` of the index one lower along the axis, and whether there is one."""
    position = {h: n for n, h in enumerate(hermite_indices(order))}
    lower = [[tuple(x - (k == axis) for k, x in enumerate(h)) for h in hermite_indices(order + 1)] for axis in range(3)]
    return (np.array([[position.get(g, 0) for g in row] for row in lower], np.int32),
            np.array([[g in position for g in row] for row in lower]))  # fmt: skip


def raised(order: int, e):
    r"""(..., 3, S, H+) the Hermite matrices ``e`` (..., S, H) of a distribution of Hermite ``order``,
    moved along each axis: d/dP_x \Lambda_{tuv} = \Lambda_{t+1,u,v}, so a centre's derivative has
    E'_{tuv} = E_{t-1,u,v} (the indices of order + 1, H+ of them)."""
    source, valid = _lowered(order)
    moved = jnp.take(e, jnp.asarray(source.reshape(-1)), axis=-1).reshape(*e.shape[:-1], 3, -1)
    return jnp.moveaxis(jnp.where(jnp.asarray(valid), moved, 0.0), -2, -3)


def _pair_derivatives(la, lb, factors: PairFactors, p, scale, ab):
    r"""(n, K2, 2, 3, S_a S_b, H+): the Hermite matrices of the derivatives of each primitive product
    with respect to its first centre A and its second B, along x, y and z, at Hermite order l_a + l_b
    + 1. E depends on A - B and the product's centre P = (aA + bB)/p moves with both, so

    .. math::

        \partial_{A_x} \Omega = \sum_{tuv} (\partial_{A_x} E_{tuv} + \tfrac{a}{p} E_{t-1,u,v}) \Lambda_{tuv},
        \quad \partial_{B_x} \Omega = \sum_{tuv} (-\partial_{A_x} E_{tuv} + \tfrac{b}{p} E_{t-1,u,v})
        \Lambda_{tuv}.

    So a derivative integral is a forward one of a distribution one order up, and the kernels need
    nothing new. The derivatives of E in A - B by forward differentiation (elementwise)."""

    def e_of(ab):
        return _pair_data(la, lb, factors, p, scale, ab)[0]

    units = jnp.broadcast_to(jnp.eye(3, dtype=ab.dtype)[:, None, :], (3, *ab.shape))  # (3, n, 3)
    e, slope = jax.vmap(lambda unit: jax.jvp(e_of, (ab,), (unit,)), out_axes=(None, 0))(units)  # slope (3, n, K2, S, H)
    moved = raised(max(la) + max(lb), e)  # (n, K2, 3, S, H+)
    slope = jnp.pad(jnp.moveaxis(slope, 0, 2), [(0, 0)] * 4 + [(0, moved.shape[-1] - e.shape[-1])])
    a, b = factors.a_frac[:, :, None, None, None], factors.b_frac[:, :, None, None, None]
    return jnp.stack([slope + a * moved, -slope + b * moved], 2)


def pair_derivative_stage(kinds, pairs, shells, difference):
    """Per pair class: (the Hermite matrices of its products' derivatives (n, K2, 6 S, H+), in the
    order (centre A or B, axis, AO pair), p, P - A, first atom, second atom) of one conformer, from
    the arguments of :func:`pair_stage`, in their precision."""
    exponents, coefficients = shells
    data = []
    for kind, (first, second, atom_a, atom_b) in zip(kinds, pairs):
        factors, p, scale = pair_factors(exponents, coefficients, first, second, kind)
        ab = difference[atom_a, atom_b]
        derivative = _pair_derivatives(kind[0], kind[1], factors, p, scale, ab)
        pa = -factors.b_frac[None] * ab.T[:, :, None]  # (3, n, K2)
        data.append((derivative.reshape(*p.shape, -1, derivative.shape[-1]), p, pa, atom_a, atom_b))
    return tuple(data)


def ket_signed(ket_order: int, e_ket):
    """The ket's Hermite matrix with the signs (-1)^(tau + nu + phi) of the Coulomb contraction, per ket
    pair as (n, Y, K2k H_k), the layout of a chunk's matmul against R."""
    n, k2, y, h = e_ket.shape
    sign = jnp.asarray([(-1.0) ** sum(g) for g in hermite_indices(ket_order)], e_ket.dtype)  # (H_k,)
    return (e_ket * sign).transpose(0, 2, 1, 3).reshape(n, y, k2 * h)


def unrolled_coulomb(bra_order: int, ket_order: int, alpha, pq, weight, shape: tuple):
    """G (J, K2k, H_k H_b, I K2b): a chunk's Hermite Coulomb integrals R_{h+g} times ``weight``, at
    the (H_k, H_b) positions of :func:`_coulomb_pairs`, from ``alpha`` (M,) and P - Q (3, M),
    M = J K2k I K2b (``shape``: (J, K2k, I K2b)), by :func:`~.hermite.hermite_coulomb`'s recursion unrolled per
    element, which XLA fuses into the values' consumers: the quicker to run."""
    j, kk, _ = shape
    r = hermite_coulomb(bra_order + ket_order, alpha, pq)
    indices = hermite_indices(bra_order + ket_order)
    r = [jnp.broadcast_to(r[h] * weight, alpha.shape).reshape(j, kk, 1, -1) for h in indices]
    pairs = _coulomb_pairs(bra_order, ket_order)  # (H_k, H_b)
    if bra_order + ket_order < GATHERED_ORDER:
        # laid out by concatenation, which XLA fuses better than a gather of the (h + g) positions
        return jnp.concatenate([r[n] for n in pairs.ravel()], 2)  # (J, K2k, H_k H_b, I K2b)
    # R materialised once, then gathered: fused into thousands of slices, each would repeat its recursion
    stacked = jax.lax.optimization_barrier(jnp.concatenate(r, 2))  # (J, K2k, H, I K2b)
    return jnp.take(stacked, jnp.asarray(pairs.ravel()), axis=2)


def stacked_coulomb(bra_order: int, ket_order: int, alpha, pq, weight, shape: tuple):
    """:func:`unrolled_coulomb`'s values by :func:`~.hermite.hermite_coulomb_stacked`'s whole-array
    recursions and one gather: a fraction of the compile time, each step slower (its stages are
    written out, not fused), so for the short stages of high angular momenta
    (``docs/decisions/device-forces.md``)."""
    j, kk, rest = shape
    r = hermite_coulomb_stacked(bra_order + ket_order, alpha, pq) * weight  # (H, M)
    r = r.reshape(-1, j, kk, rest).transpose(1, 2, 0, 3)  # (J, K2k, H, I K2b)
    return jnp.take(r, jnp.asarray(_coulomb_pairs(bra_order, ket_order).ravel()), axis=2)


def _ket_contracted(bra_order, ket_order, bra, ket, signed, omega: float = 0.0, coulomb=unrolled_coulomb):
    """(J, S_c S_d, H_b, I, K2b): one CHUNK x CHUNK square of quartets' ERIs before the bra's Hermite
    matrices contract them (:func:`chunk_of`), from the data of its I bra
    pairs (E (I, K2b, S_ab, H_b), p (I, K2b), P - A (3, I, K2b)) and J ket pairs (p (J, K2k), P - A
    (3, J, K2k), the signed Hermite matrices of :func:`ket_signed`, and A - C (J, I, 3)).

    ``omega`` > 0 gives the integrals of the long-range operator erf(ω r)/r instead of 1/r (a traced
    ``omega`` picks the operator at run time, 0 for 1/r): with
    erf(ω r)/r = (2/√π) ∫_0^ω exp(-t² r²) dt, each primitive quartet is the Coulomb one with α replaced
    by α ω²/(α + ω²) in R and the prefactor multiplied by (ω²/(α + ω²))^{1/2} (Ahlrichs, Phys. Chem.
    Chem. Phys. 8, 3072 (2006)).

    Primitive quartets are laid out (J, K2k, I K2b): XLA's CPU loops vectorise along the last axis
    only, and this one is long. R (with the prefactor) is laid out as G[(l, g), (h, i, k)] =
    R_{h+g}(ket primitive pair l, bra pair i, bra primitive pair k), which the ket's signed Hermite
    matrices contract in one matmul per ket pair, (Y, K2k H_k) x (K2k H_k, H_b I K2b); then the
    bra's Hermite matrices contract the result. ``coulomb`` lays out R (:func:`unrolled_coulomb` or
    :func:`stacked_coulomb`).
    """
    _, p_b, pa_b = bra
    p_k, pa_k, ket_chunk, ac = ket
    m = jax.lax.dynamic_index_in_dim(signed, ket_chunk, keepdims=False)  # (J, Y, K2k H_k)
    j, kk = p_k.shape
    i, kb = p_b.shape
    # Every primitive quartet's P - Q (x, y, z), as a batched matmul of pair factors per ket pair,
    # (K2k, 2) x (2, I K2b): it writes them flat and contiguous, where broadcasting costs XLA index
    # arithmetic per element. P - Q = ((A - C) + (P - A))
    # - (Q - C), A - C from the host's float64 table; the products are by 1, so the sums are those
    # of the elementwise form.
    dtype = pa_b.dtype
    bra_part = ac.transpose(2, 0, 1)[..., None] + pa_b[:, None]  # (3, J, I, K2b)
    left = jnp.stack([jnp.ones((3, j, kk), dtype), -pa_k], -1)  # (3, J, K2k, 2)
    right = jnp.stack([bra_part.reshape(3, j, -1), jnp.ones((3, j, i * kb), dtype)], 2)  # (3, J, 2, I K2b)
    pq = jnp.matmul(left, right).reshape(3, -1)  # (3, M), M = J K2k I K2b
    # p + q and pq the same way; they do not depend on the geometry (computed once for all conformers)
    left = jnp.stack([p_k.reshape(-1), jnp.ones(j * kk, p_k.dtype)], -1)  # (J K2k, 2)
    total = (left @ jnp.stack([jnp.ones(i * kb, p_b.dtype), p_b.reshape(-1)])).reshape(-1)
    product = (p_k.reshape(-1, 1) @ p_b.reshape(1, -1)).reshape(-1)
    # 1/sqrt would become rsqrt, whose float32 values run 1e-8 low on average: sqrt and a division do not
    alpha, weight = product / total, scaled(jnp.sqrt(total) / total, 2.0 * math.pi**2.5)
    if is_traced(omega):  # either operator, chosen at run time: one kernel serves both (the gradients')
        squared = omega * omega
        attenuation = jnp.where(omega > 0, squared / (alpha + squared), 1.0)
        alpha, weight = alpha * attenuation, weight * jnp.sqrt(attenuation)
    elif omega:  # long-range: attenuated (a Python branch: the Coulomb program is unchanged)
        attenuation = omega**2 / (alpha + omega**2)
        alpha, weight = alpha * attenuation, weight * jnp.sqrt(attenuation)
    g = coulomb(bra_order, ket_order, alpha, pq, weight, (j, kk, i * kb))  # (J, K2k, H_k H_b, I K2b)
    pairs = _coulomb_pairs(bra_order, ket_order)  # (H_k, H_b)
    t = jnp.matmul(m, g.reshape(j, kk * pairs.shape[0], -1))  # (J, Y, H_b I K2b)
    return t.reshape(j, -1, pairs.shape[1], i, kb)


def chunk_of(bra_order, ket_order, bra, ket, signed, omega: float = 0.0, coulomb=unrolled_coulomb):
    """(I, S_a S_b, J, S_c S_d) ERIs of one CHUNK x CHUNK square of quartets (:func:`_ket_contracted`
    gives the arguments and the method), the bra's Hermite matrices contracted last."""
    t = _ket_contracted(bra_order, ket_order, bra, ket, signed, omega, coulomb)  # (J, Y, H_b, I, K2b)
    return jnp.einsum("jyhik,ikxh->ixjy", t, bra[0])


def weighted_bra_derivative(bra_order, ket_order, bra, ket, signed, weights, omega: float = 0.0):
    """(I, 2, 3) sum over the chunk of ``weights`` (I, S_ab, J, S_cd) times the ERIs' derivatives in
    each bra pair's two centres, from :func:`chunk_of`'s arguments with the bra's raised Hermite
    matrices (I, K2b, 6 S_ab, H_b) (:func:`pair_derivative_stage`): the weights contract the ket side
    first, so the derivative values themselves, six times the chunk's ERIs, are never formed."""
    t = _ket_contracted(bra_order, ket_order, bra, ket, signed, omega)  # (J, Y, H_b, I, K2b)
    z = jnp.einsum("jyhik,isjy->iksh", t, weights)  # (I, K2b, S_ab, H_b)
    e = bra[0]
    return jnp.einsum("ikcash,iksh->ica", e.reshape(*e.shape[:2], 2, 3, -1, e.shape[-1]), z)


def is_traced(value) -> bool:
    """Whether ``value`` is an array (known at run time), not a Python number (known as it is traced)."""
    return not isinstance(value, (int, float))


def by_chunk(x, index, axis=0):
    """The rows of ``x`` (along ``axis``) of chunks ``index`` (T,): (T, ..., CHUNK, ...) with T leading."""
    shape = x.shape[:axis] + (-1, CHUNK) + x.shape[axis + 1 :]
    # indices are in range by construction: clip spares the out-of-range select of the default mode
    return jnp.moveaxis(jnp.take(x.reshape(shape), index, axis=axis, mode="clip"), axis, 0)


def pair_stage(kinds, pairs, shells, difference, present, dtype: str):
    """Per pair class: (Hermite matrices, p, P - A, first atom, whether both atoms are there) of one
    conformer, from its shells' exponents and coefficients ``shells`` = ((S, K), (S, C, K)), the
    atoms' differences ``difference`` (natm, natm, 3) and which atoms are there, ``present``
    (natm,); computed in their precision (float64 from host positions) and rounded to ``dtype``
    inside the program (cast outside it, each cast would be a program of its own). ``kinds``: each
    class's (l_a, l_b, K_a, K_b); ``pairs``: its (first shells, second shells, first atoms, second
    atoms)."""
    exponents, coefficients = shells
    data = []
    for kind, (first, second, atom_a, atom_b) in zip(kinds, pairs):
        factors, p, scale = pair_factors(exponents, coefficients, first, second, kind)
        e, pa = _pair_data(kind[0], kind[1], factors, p, scale, difference[atom_a, atom_b])
        data.append((e.astype(dtype), p.astype(dtype), pa.astype(dtype), atom_a, present[atom_a] & present[atom_b]))
    return tuple(data)


def quartet_stage(static, quartet_arrays, one_centre, data, shifts, rows):
    """The s8 array: the one-centre constants, then every quartet class's chunks (those with nothing
    to compute, the padding of a size bucket's full chunk grids and the chunks of pairs of atoms that
    are not there, a template's absent slots, are skipped). ``one_centre``: (positions (M,), values
    (M,)) of the integrals with all four AOs on one atom; ``rows``: per pair class, each row's values'
    AO pairs and repeats (S, R), the atom its two shells share (R,; -1 if none) and whether it is a
    real pair (R,) (:func:`~.eri.eri_rows`).

    With a screening threshold (``static``), each class's rows are first sorted by their Schwarz
    bound, the largest sqrt|(ij|ij)| of their values (from the kernel's own diagonal chunks), so that
    the quartets of small pairs gather in whole chunks: a chunk whose first bra and ket rows' bounds
    multiply to less than the threshold is skipped (its values are zeros). The destinations follow
    the rows, so the compiled program is the same for every geometry (``docs/decisions/eri-screening.md``)."""
    kinds, quartet_classes, size, batch, omega, threshold = static
    one_centre_index, one_centre_value = one_centre
    out = jnp.zeros(size, shifts.dtype).at[one_centre_index].set(one_centre_value.astype(shifts.dtype), mode="drop")
    if threshold:  # each class's rows by their bounds, largest first; the bounds in that order
        bounds = pair_bounds(kinds, data, shifts, rows, omega)
        order = [jnp.argsort(-b, stable=True) for b in bounds]
        bounds = [b[o] for b, o in zip(bounds, order)]
        data = [(e[o], p[o], pa[:, o], atom[o], there[o]) for (e, p, pa, atom, there), o in zip(data, order)]
        rows = [(aos[:, o], repeat[:, o], atom[o], real[o]) for (aos, repeat, atom, real), o in zip(rows, order)]
    for (x, y), (chunks, active, dealt) in zip(quartet_classes, quartet_arrays):
        orders = tuple(max(kinds[c][0]) + max(kinds[c][1]) for c in (x, y))  # Hermite orders of bra, ket
        (e_bra, *_, there_bra), (e_ket, *_, there_ket) = data[x], data[y]
        if threshold:  # a chunk's largest bounds are its first rows'
            work = dealt & (bounds[x][CHUNK * chunks[:, 0]] * bounds[y][CHUNK * chunks[:, 1]] >= threshold)
        else:  # a chunk computes where it has work and both sides hold a pair of atoms that are there
            work = active & by_chunk(there_bra, chunks[:, 0]).any(-1) & by_chunk(there_ket, chunks[:, 1]).any(-1)
        bra, ket, signed = chunk_arguments(data[x], data[y], orders[1], chunks, shifts)
        shape = (CHUNK, e_bra.shape[2], CHUNK, e_ket.shape[2])

        def chunk(arguments, orders=orders, signed=signed, shape=shape):
            work, bra_chunk, ket_chunk = arguments
            return jax.lax.cond(work, lambda: chunk_of(*orders, bra_chunk, ket_chunk, signed, omega),
                                lambda: jnp.zeros(shape, shifts.dtype))  # fmt: skip

        # checkpointed: a gradient recomputes each chunk instead of keeping every chunk's Boys values.
        # One chunk at a time (a CPU) is a plain map: with batch_size, even 1, the kernel is vmapped,
        # and a vmapped cond computes both branches, so idle chunks would cost as much as busy ones.
        values = jax.lax.map(jax.checkpoint(chunk), (work, bra, ket), batch_size=batch if batch > 1 else None)
        destination = chunk_destinations(rows[x], rows[y], chunks, dealt, x == y)
        out = out.at[destination.reshape(-1)].set(values.reshape(-1), mode="drop", unique_indices=True)
    return out


def chunk_arguments(bra_pairs, ket_pairs, ket_order: int, chunks, shifts):
    """What :func:`chunk_of` reads for each of ``chunks`` (T, 2) of one quartet class, from its bra's
    and ket's pair data (:func:`pair_stage`), gathered up front so that each kernel reads only its own
    slice: per chunk the bra's (E, p, P - A) and the ket's (p, P - A, chunk, A - C (T, J, I, 3))
    (:func:`chunk_sides`), and the ket's signed Hermite matrices by chunk (:func:`ket_signed`: indexed
    per chunk, not copied)."""
    signed = ket_signed(ket_order, ket_pairs[0])
    return (*chunk_sides(bra_pairs, ket_pairs, chunks, shifts), signed.reshape(-1, CHUNK, *signed.shape[1:]))


def chunk_sides(bra_pairs, ket_pairs, chunks, shifts):
    """The bra's and the ket's data of ``chunks`` (T, 2) as :func:`chunk_of` reads them (see
    :func:`chunk_arguments`), each with a leading axis of T."""
    (e_bra, p_bra, pa_bra, atom_bra, _), (_, p_ket, pa_ket, atom_ket, _) = bra_pairs, ket_pairs
    b, k = chunks[:, 0], chunks[:, 1]
    ac = shifts[by_chunk(atom_bra, b)[:, None, :], by_chunk(atom_ket, k)[:, :, None]]
    return ((by_chunk(e_bra, b), by_chunk(p_bra, b), by_chunk(pa_bra, b, 1)),
            (by_chunk(p_ket, k), by_chunk(pa_ket, k, 1), k, ac))  # fmt: skip


def chunk_destinations(bra_rows, ket_rows, chunks, dealt, same_class: bool):
    """(T, I, S_ab, J, S_cd) int32: the s8 index of every value of the chunks ``chunks`` (T, 2) of one
    quartet class, from its bra's and ket's row tables (in the order the kernel reads the rows); NOWHERE
    for the values that are not computed here: repeats, pairs that are padding, one-centre quartets (the
    plan's constants), and the chunks of a share's padding (not ``dealt``). Within one class a quartet
    of two rows is the bra's where its row comes later, and a row with itself keeps ij >= kl."""
    def side(tables, index):  # one side's tables at each chunk's rows
        aos, repeat, atom, real = tables
        rows = CHUNK * index[:, None] + jnp.arange(CHUNK)  # (T, CHUNK)
        return rows, aos[:, rows], repeat[:, rows], atom[rows], real[rows]  # (S, T, CHUNK) or (T, CHUNK)

    b_rows, ij, b_repeat, b_atom, b_real = side(bra_rows, chunks[:, 0])
    k_rows, kl, k_repeat, k_atom, k_real = side(ket_rows, chunks[:, 1])
    ij = ij.transpose(1, 2, 0)[:, :, :, None, None]  # (T, I, S_ab, 1, 1)
    kl = kl.transpose(1, 2, 0)[:, None, None, :, :]  # (T, 1, 1, J, S_cd)
    hi, lo = jnp.maximum(ij, kl), jnp.minimum(ij, kl)
    # hi (hi + 1) / 2 with the even factor halved first: it fits int32 wherever the s8 index does
    index = jnp.where(hi % 2 == 0, (hi >> 1) * (hi + 1), hi * ((hi + 1) >> 1)) + lo
    bra = lambda a: a[:, :, None, None, None]  # noqa: E731  (T, I) -> (T, I, 1, 1, 1)
    ket = lambda a: a[:, None, None, :, None]  # noqa: E731  (T, J) -> (T, 1, 1, J, 1)
    drop = b_repeat.transpose(1, 2, 0)[:, :, :, None, None] | k_repeat.transpose(1, 2, 0)[:, None, None, :, :]
    drop |= ~(bra(b_real) & ket(k_real) & bra(dealt[:, None]))
    drop |= bra(b_atom >= 0) & (bra(b_atom) == ket(k_atom))  # all four shells on one atom
    if same_class:
        drop |= (bra(b_rows) < ket(k_rows)) | ((bra(b_rows) == ket(k_rows)) & (ij < kl))
    return jnp.where(drop, NOWHERE, index)


def pair_bounds(kinds, data, shifts, rows, omega: float):
    """Per pair class, each row's Schwarz bound (R,): the largest sqrt|(ij|ij)| over its values, from the
    diagonal of its class's own diagonal chunks; 0 for rows that are padding or whose atoms are not there
    (|(ij|kl)| <= sqrt((ij|ij) (kl|kl)) for the Coulomb and the long-range operator alike)."""
    out = []
    for kind, pairs, (_, _, _, real) in zip(kinds, data, rows):
        order = max(kind[0]) + max(kind[1])
        e, *_, there = pairs
        index = jnp.arange(e.shape[0] // CHUNK)
        bra, ket, signed = chunk_arguments(pairs, pairs, order, jnp.stack([index, index], 1), shifts)

        def diagonal(arguments, order=order, signed=signed):
            values = chunk_of(order, order, *arguments, signed, omega)  # (I, S, I, S)
            own = jnp.arange(CHUNK)
            return jnp.abs(jnp.diagonal(values[own, :, own, :], axis1=1, axis2=2)).max(-1)  # (CHUNK,)

        bound = jnp.sqrt(jax.lax.map(diagonal, (bra, ket)).reshape(-1))
        out.append(jnp.where(real & there, bound, 0.0))
    return out


def _pair_program(kinds, pairs, shells, coords, present, dtype: str):
    """:func:`pair_stage` over conformers: ``shells`` ((C, S, K), (C, S, C', K)), ``coords``
    (C, natm, 3) and ``present`` (C, natm) batched, the plan's ``pairs`` shared. Returns (pair data,
    the atoms' differences (C, natm, natm, 3) in ``dtype``), the differences formed in the shells'
    precision (float64 from concrete positions)."""
    coords = coords.astype(shells[0].dtype)

    def member(member_shells, member_coords, member_present):
        difference = member_coords[:, None, :] - member_coords[None, :, :]
        return pair_stage(kinds, pairs, member_shells, difference, member_present, dtype), difference.astype(dtype)

    return jax.vmap(member)(shells, coords, present)


def _quartet_program(static, quartet_arrays, one_centre, data, shifts, rows, at_once: int):
    """:func:`quartet_stage` of the batch's conformers, ``at_once`` of them together
    (:func:`~pyscf_ipu.programs.map_members`: on a CPU one after another, so that a chunk's arrays stay
    cache-sized). The plan's ``quartet_arrays`` and one-centre positions are shared; ``one_centre`` =
    (positions (M,), selection (M,) into each conformer's one-centre values (C, M'), one past whose end
    selects a zero), then ``data`` and ``shifts`` per conformer."""
    index, selection, values = one_centre
    values = jnp.concatenate([values, jnp.zeros((values.shape[0], 1), values.dtype)], axis=1)
    return map_members(lambda member: quartet_stage(static, quartet_arrays, (index, member[0][selection]), *member[1:],
                                                     rows), (values, data, shifts), at_once)  # fmt: skip


def quartet_member_bytes(static, pairs, itemsize: int) -> int:
    """One conformer's temporaries in the quartet program, for :func:`~pyscf_ipu.programs.members_at_once`:
    its s8 array as computed, and one step of the chunk map over the largest class (per primitive
    quartet its Hermite integrals R and the bra-ket matrix of them, and each chunk's values).
    ``static``: the plan's :func:`~.eri.static_tables`; ``pairs``: its pair classes."""
    _, classes, size, batch, _, _ = static
    largest = 0
    for x, y in classes:
        bra, ket = pairs[x], pairs[y]
        primitives = CHUNK * CHUNK * bra.ka * bra.kb * ket.ka * ket.kb
        hermite = [len(hermite_indices(order)) for order in (bra.order, ket.order, bra.order + ket.order)]
        values = primitives * (hermite[2] + hermite[0] * hermite[1] + 8) + CHUNK * CHUNK * bra.functions * ket.functions
        largest = max(largest, values)
    return itemsize * (size + batch * largest)


pair_program = compiled(_pair_program, static_argnums=(0, 5), name="eri_pairs", quick_compile=True)
quartet_program = compiled(
    _quartet_program, static_argnums=(0, 6), name="eri_quartets",
    # a 6-31G* program holds thousands of memory mappings: drop old ones before the process nears its limit
    budget=MappingBudget(share=0.5, fallback=3))
