r"""The exact two-electron gradient on the device: derivative ERIs, contracted with their weights as
they are made.

With each s8-packed ERI u = (ij|kl) weighted by w_u = dE_2/d(u) (its multiplicity times its density
products), the gradient is :math:`\sum_u w_u \nabla_R (ij|kl)`. The derivative of a primitive pair's
product in either of its centres is again a Hermite expansion about the same centre, one order up
(:func:`~.eri_kernels.pair_derivative_stage`), so a chunk of derivative ERIs in the bra's two
centres is the forward kernel's chunk (:func:`~.eri_kernels.chunk_of`) with the bra's Hermite
matrices raised; the ket's two centres come from the same chunk with bra and ket swapped
((ij|kl) = (kl|ij)). Each chunk's values are contracted with the weights at their s8 destinations
(:func:`~.eri_kernels.chunk_destinations`, the forward kernel's, so every unique quartet counts once)
and added to their atoms: no derivative tensor is held, and nothing is differentiated by
``jax.grad``, whose reverse pass through the quartet map compiled for half a minute at STO-3G and
ran several times the forward kernel's time (``docs/decisions/device-forces.md``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..packed import traced_tril_unpack
from .eri_kernels import (by_chunk, chunk_destinations, chunk_sides, ket_signed, pair_derivative_stage, pair_stage,
                          weighted_bra_derivative)
from .eri_plan import CHUNK, NOWHERE


def eri_weights(dm, coulomb: float, exchange: float, size: int, dtype):
    """(size,) dE_2/d(u) for every s8-packed ERI u at the density ``dm`` (N, N), of the energy
    ``coulomb`` E_J + ``exchange`` E_K: m_u (c D_pq D_rs / 2 - a (D_pr D_qs + D_ps D_qr) / 8), m_u the
    number of distinct index permutations of u."""
    u = jnp.arange(size, dtype=jnp.int64)
    ij, kl = traced_tril_unpack(u)
    (p, q), (r, s) = traced_tril_unpack(ij), traced_tril_unpack(kl)
    multiplicity = 8.0 / ((1.0 + (p == q)) * (1.0 + (r == s)) * (1.0 + (ij == kl)))
    hartree = 0.5 * coulomb * dm[p, q] * dm[r, s]
    exact = 0.125 * exchange * (dm[p, r] * dm[q, s] + dm[p, s] * dm[q, r])
    return (multiplicity * (hartree - exact)).astype(dtype)


def _raised_kinds(classes, quartet_arrays) -> dict:
    """The chunks of every quartet class, by the pair class whose derivatives they take and the other:
    {(raised, plain): [(chunks (T, 2) as (raised chunk, plain chunk), whether each has values, whether
    it is dealt, whether it is a class's ket raised (flipped))]}. Each class's chunks appear twice, its
    bra raised and its ket raised, so that every (raised, plain) combination is one kernel."""
    out: dict = {}
    for (x, y), (chunks, active, dealt) in zip(classes, quartet_arrays):
        out.setdefault((x, y), []).append((chunks, active & dealt, dealt, jnp.zeros(dealt.shape, bool)))
        out.setdefault((y, x), []).append((chunks[:, ::-1], active & dealt, dealt, jnp.ones(dealt.shape, bool)))
    return out


def exact_gradient_member(static, arrays, shells, coords, present, weights, omega):
    """(natm, 3) one conformer's exact two-electron gradient, :math:`\\sum_u w_u \\nabla (u)`.

    ``static``: the plan's :func:`~.eri.static_tables` (no screening; its ω not read: ``omega`` is the
    operator's, a number, or an array that picks the operator at run time, so that one program serves
    both of a range-separated functional's);
    ``arrays``: the plan's (per quartet class (chunks, whether each has values, whether it is dealt) of
    its single share, :func:`~.eri.eri_rows`, :func:`~.eri.eri_structure`);
    ``shells``: the conformer's ((S, K), (S, C', K)); ``coords`` (natm, 3) Bohr in the kernels'
    precision; ``present`` (natm,) the atoms there; ``weights`` (size,) :func:`eri_weights`.

    Every chunk is computed twice, its bra's derivatives against its ket's values and its ket's against
    its bra's; the chunks that raise one pair class against another form one map, whatever quartet
    class they come from (:func:`_raised_kinds`), so each such combination compiles one kernel."""
    kinds, classes, _, batch, _, _ = static
    quartet_arrays, rows, structure = arrays
    dtype = coords.dtype
    difference = coords[:, None, :] - coords[None, :, :]  # (natm, natm, 3)
    data = pair_stage(kinds, structure, shells, difference, present, dtype.name)
    derivatives = tuple((d.astype(dtype), p.astype(dtype), pa.astype(dtype), a, b)
                        for d, p, pa, a, b in pair_derivative_stage(kinds, structure, shells, difference))  # fmt: skip
    orders = [max(la) + max(lb) for la, lb, _, _ in kinds]
    total = jnp.float64  # the chunks' sums added in float64
    gradient = jnp.zeros(coords.shape, total)
    for (r, o), parts in _raised_kinds(classes, quartet_arrays).items():
        chunks, work, dealt, flipped = (jnp.concatenate(a) for a in zip(*parts))
        work &= by_chunk(data[r][4], chunks[:, 0]).any(-1) & by_chunk(data[o][4], chunks[:, 1]).any(-1)
        signed = ket_signed(orders[o], data[o][0])
        signed = signed.reshape(-1, CHUNK, *signed.shape[1:])

        def chunk(arguments, r=r, o=o, signed=signed):
            work, pair, own, flip = arguments

            def compute():  # each chunk's data gathered in its own step: a derivative's is six times the ERIs'
                sides = jax.tree.map(lambda a: a[0], chunk_sides(derivatives[r], data[o], pair[None], difference))
                if r == o:  # a class with itself: its destinations as the quartet class orders the chunk
                    original = jnp.where(flip, pair[::-1], pair)
                    destination = chunk_destinations(rows[r], rows[r], original[None], own[None], True)[0]
                    destination = jnp.where(flip, destination.transpose(2, 3, 0, 1), destination)
                else:  # the s8 index is symmetric in the two pairs, whichever is the bra
                    destination = chunk_destinations(rows[r], rows[o], pair[None], own[None], False)[0]
                w = jnp.where(destination != NOWHERE, jnp.take(weights, destination, mode="clip"), 0.0)
                return weighted_bra_derivative(orders[r] + 1, orders[o], *sides, signed, w, omega).astype(total)

            return jax.lax.cond(work, compute, lambda: jnp.zeros((CHUNK, 2, 3), total))

        side = jax.lax.map(chunk, (work, chunks, dealt, flipped), batch_size=batch if batch > 1 else None)  # (T, CHUNK, 2, 3)
        _, _, _, atom_a, atom_b = derivatives[r]
        gradient = gradient.at[by_chunk(atom_a, chunks[:, 0])].add(side[:, :, 0])
        gradient = gradient.at[by_chunk(atom_b, chunks[:, 0])].add(side[:, :, 1])
    return gradient
