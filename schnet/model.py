r"""SchNet (Schuett et al., NeurIPS 2017; J. Chem. Phys. 148, 241722 (2018)) in JAX with equinox.

Equinox rather than flax: its modules are plain pytrees, so ``jax.jit``, ``vmap``, ``shard_map``
and checkpointing (``eqx.tree_serialise_leaves``) apply to the model directly, with no separate
variable collections; that is how every state object of this project is handled.

A batch of graphs (atoms flat, padded to N atoms and E edges, with masks) goes through

1. embedding: x_i = E[z_i], (A, F);
2. neighbours: the k nearest atoms within the cutoff (``neighbours=k``), or every atom within the
   cutoff (``neighbours=None``), as a fixed-size list of atom pairs computed inside jit (see
   :func:`neighbour_pairs`); the atoms of a batch are flat, each tagged with its graph;
3. T interaction blocks, each x_i += Dense(ssp(Dense(sum_j Dense(x_j) * W(d_ij)))), with the
   continuous filter W(d) = Dense(ssp(Dense(rbf(d)))) * C(d): Gaussians exp(-gamma (d - mu_g)^2)
   with centres mu_g evenly spaced on [0, cutoff] and gamma = 1 / (2 spacing^2), and the cosine
   cutoff C(d) = (cos(pi d / cutoff) + 1) / 2 for d < cutoff, else 0;
4. an atom-wise MLP F -> F/2 -> 1 and the sum over each graph's real atoms.

ssp(x) = softplus(x) - log 2 is the shifted softplus. Distances are in Angstrom.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .config import SchNetConfig


@jax.custom_jvp
def shifted_softplus(x):
    """ssp(x) = log(1 + e^x) - log 2, as max(x, 0) + log(1 + e^-|x|) - log 2 (no overflow).

    log(1 + e) rather than log1p(e): e is in (0, 1], so the two differ by less than float32's
    resolution of the result near log 2 (absolute error <= 6e-8), and XLA's CPU log is faster.
    """
    return _ssp(x, jnp.exp(-jnp.abs(x)))


def _ssp(x, e):
    """ssp(x) given e = exp(-|x|)."""
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + e) - math.log(2.0)


@shifted_softplus.defjvp
def _shifted_softplus_jvp(primals, tangents):
    """The derivative sigmoid(x) from the same e^-|x| as the value: one exp per element for both.

    ``jax.nn.softplus`` (logaddexp) evaluates its exponentials again for the derivative; on the
    (pairs, filters) arrays of the filter network that made the shifted softplus the largest
    elementwise cost of a training step.
    """
    (x,), (dx,) = primals, tangents
    e = jnp.exp(-jnp.abs(x))
    return _ssp(x, e), jnp.where(x >= 0, 1.0, e) / (1.0 + e) * dx


def dense(layer: eqx.nn.Linear, x):
    """An equinox Linear applied over any leading axes: (..., in) -> (..., out)."""
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


class Pairs(NamedTuple):
    """A fixed-size list of atom pairs i < j joined by an edge in at least one direction.

    The continuous filter depends on the distance only, so one evaluation per pair serves both
    directions (the messages j -> i and i -> j); with symmetric neighbourhoods (a radius graph, or
    k at least the atoms of a molecule) that halves the filter network's work against an edge list.
    """

    first: jax.Array  # (P,) i, sorted
    second: jax.Array  # (P,) j > i, same graph
    distance: jax.Array  # (P,) Angstrom; the cutoff on padding pairs (so the cosine envelope is 0)
    forward: jax.Array  # (P,) 1.0 if i receives a message from j, else 0.0
    backward: jax.Array  # (P,) 1.0 if j receives a message from i, else 0.0
    count: jax.Array  # () pairs wanted; more than P means the budget was too small


def neighbour_pairs(pos, atom_mask, graph_index, k: int | None, cutoff: float, max_pairs: int, window: int) -> Pairs:
    """The neighbour pairs of a flat batch of atoms, computed inside jit with fixed shapes.

    Atom i receives messages from j if both are real atoms of the same graph, j != i, their
    distance is below the cutoff and (``k`` given) j is among i's k nearest atoms (distance at most
    the k-th smallest); k nearest is not symmetric, so each pair carries a flag per direction. A
    graph's atoms are contiguous, so i's candidates are the ``window`` atoms from the start of its
    graph (``window`` >= the largest graph): the search costs N x window, not N^2. The pairs are
    compacted, in order of i, to ``max_pairs``; the batcher sizes batches so that they fit (see
    :func:`schnet.data.pair_count`), and ``count`` lets the caller check.
    """
    n = pos.shape[0]
    atoms = jnp.arange(n)
    counts = jax.ops.segment_sum(atom_mask.astype(jnp.int32), graph_index, n)  # (N,) atoms per graph id
    first = (jnp.cumsum(counts) - counts)[graph_index]  # (N,) flat index of the first atom of i's graph
    slots = first[:, None] + jnp.arange(window)  # (N, window) i's graph, then whatever follows it
    valid = (slots < (first + counts[graph_index])[:, None]) & (slots != atoms[:, None]) & atom_mask[:, None]
    candidate = jnp.minimum(slots, n - 1)  # in range for the gathers; slots past the graph are masked
    diff = pos[:, None, :] - pos[candidate]  # (N, window, 3)
    # sqrt of a positive value only, so no NaN gradient from masked pairs
    dist = jnp.sqrt(jnp.where(valid, jnp.sum(diff * diff, axis=-1), 1.0))  # (N, window)
    receives = valid & (dist < cutoff)  # (N, window): i receives from candidate
    if k is not None and k < window - 1:
        kth = -jax.lax.top_k(-jnp.where(valid, dist, jnp.inf), k)[0][:, -1]  # (N,) k-th smallest distance
        receives &= dist <= kth[:, None]
    rank = jnp.minimum(atoms - first, window - 1)  # (N,) i's slot in the window of its graph's atoms
    sends = valid & receives[candidate, rank[:, None]]  # (N, window): candidate receives from i
    pair = (receives | sends) & (slots > atoms[:, None])
    i, s = jnp.nonzero(pair, size=max_pairs, fill_value=0)
    real = jnp.arange(max_pairs) < jnp.sum(pair)
    flag = lambda m: (m[i, s] & real).astype(pos.dtype)  # noqa: E731
    return Pairs(i, candidate[i, s], jnp.where(real, dist[i, s], cutoff), flag(receives), flag(sends), jnp.sum(pair))


class Interaction(eqx.Module):
    """One interaction block: continuous-filter convolution and an atom-wise update, with a residual."""

    filter_in: eqx.nn.Linear  # gaussians -> filters
    filter_out: eqx.nn.Linear  # filters -> filters
    atom_in: eqx.nn.Linear  # features -> filters, no bias
    atom_out: eqx.nn.Linear  # filters -> features
    update: eqx.nn.Linear  # features -> features

    def __init__(self, config: SchNetConfig, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        f, w = config.features, config.filters
        self.filter_in = eqx.nn.Linear(config.gaussians, w, key=k1)
        self.filter_out = eqx.nn.Linear(w, w, key=k2)
        self.atom_in = eqx.nn.Linear(f, w, use_bias=False, key=k3)
        self.atom_out = eqx.nn.Linear(w, f, key=k4)
        self.update = eqx.nn.Linear(f, f, key=k5)

    def __call__(self, x, rbf, envelope, pairs: Pairs):
        """x (N, F); rbf (P, G) and envelope (P,) (cutoff weights, 0 on padding) of the pairs."""
        w = dense(self.filter_out, shifted_softplus(dense(self.filter_in, rbf)))  # (P, W), once per pair
        h = dense(self.atom_in, x)  # (N, W)
        to_first = h[pairs.second] * (w * (envelope * pairs.forward)[:, None])  # (P, W) j -> i
        to_second = h[pairs.first] * (w * (envelope * pairs.backward)[:, None])  # (P, W) i -> j
        n = x.shape[0]
        messages = (jax.ops.segment_sum(to_first, pairs.first, n, indices_are_sorted=True)
                    + jax.ops.segment_sum(to_second, pairs.second, n))  # (N, W)  # fmt: skip
        return x + dense(self.update, shifted_softplus(dense(self.atom_out, messages)))


class SchNet(eqx.Module):
    """SchNet on a flat batch: ``model(z, pos, atom_mask, graph_index, num_graphs, max_edges, window)``.

    z (N,), pos (N, 3) Angstrom, atom_mask (N,), graph_index (N,) the graph of each atom (a graph's
    atoms contiguous); returns ((num_graphs,) sums of the atom outputs, the edges wanted).
    ``num_graphs``, ``max_edges`` and ``window`` (atoms of the largest graph) are static: one
    compiled function per batch layout.
    """

    config: SchNetConfig = eqx.field(static=True)
    embedding: eqx.nn.Embedding
    interactions: tuple[Interaction, ...]
    head_hidden: eqx.nn.Linear  # features -> features / 2
    head_out: eqx.nn.Linear  # features / 2 -> 1

    def __init__(self, config: SchNetConfig, *, key):
        keys = jax.random.split(key, config.interactions + 3)
        self.config = config
        self.embedding = eqx.nn.Embedding(config.max_z, config.features, key=keys[0])
        self.interactions = tuple(Interaction(config, k) for k in keys[1 : config.interactions + 1])
        half = max(config.features // 2, 1)
        self.head_hidden = eqx.nn.Linear(config.features, half, key=keys[-2])
        self.head_out = eqx.nn.Linear(half, 1, key=keys[-1])

    def radial_basis(self, dist):
        """(...,) distances -> (..., G) Gaussians on [0, cutoff]."""
        c = self.config
        centres = jnp.linspace(0.0, c.cutoff, c.gaussians)
        spacing = c.cutoff / max(c.gaussians - 1, 1)
        return jnp.exp(-0.5 / spacing**2 * (dist[..., None] - centres) ** 2)

    def atom_outputs(self, z, pos, atom_mask, graph_index, max_pairs: int, window: int):
        """((N,) per-atom contributions, zero on padding; the pairs wanted)."""
        c = self.config
        pairs = neighbour_pairs(pos, atom_mask, graph_index, c.neighbours, c.cutoff, max_pairs, window)
        envelope = 0.5 * (jnp.cos(jnp.pi * pairs.distance / c.cutoff) + 1.0)  # (P,); padding sits at the cutoff
        rbf = self.radial_basis(pairs.distance)  # (P, G)
        x = self.embedding.weight[z]  # (N, F)
        for block in self.interactions:
            x = block(x, rbf, envelope, pairs)
        out = dense(self.head_out, shifted_softplus(dense(self.head_hidden, x)))[:, 0]
        return jnp.where(atom_mask, out, 0.0), pairs.count

    def __call__(self, z, pos, atom_mask, graph_index, num_graphs: int, max_pairs: int, window: int):
        out, wanted = self.atom_outputs(z, pos, atom_mask, graph_index, max_pairs, window)
        return jax.ops.segment_sum(out, graph_index, num_graphs), wanted


def parameter_count(model: eqx.Module) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
