r"""SchNet (Schuett et al., NeurIPS 2017; J. Chem. Phys. 148, 241722 (2018)) in JAX with equinox.

Equinox rather than flax: its modules are plain pytrees, so ``jax.jit``, ``vmap``, ``shard_map``
and checkpointing (``eqx.tree_serialise_leaves``) apply to the model directly, with no separate
variable collections; that is how every state object of this project is handled.

One graph (padded to A atoms, with an atom mask) goes through

1. embedding: x_i = E[z_i], (A, F);
2. neighbours: the k nearest atoms within the cutoff (``neighbours=k``, fixed shapes, computed
   inside jit), or every atom within the cutoff (``neighbours=None``); masks drop padding;
3. T interaction blocks, each x_i += Dense(ssp(Dense(sum_j Dense(x_j) * W(d_ij)))), with the
   continuous filter W(d) = Dense(ssp(Dense(rbf(d)))) * C(d): Gaussians exp(-gamma (d - mu_g)^2)
   with centres mu_g evenly spaced on [0, cutoff] and gamma = 1 / (2 spacing^2), and the cosine
   cutoff C(d) = (cos(pi d / cutoff) + 1) / 2 for d < cutoff, else 0;
4. an atom-wise MLP F -> F/2 -> 1 and the sum over the real atoms.

ssp(x) = softplus(x) - log 2 is the shifted softplus. Distances are in Angstrom.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .config import SchNetConfig


def shifted_softplus(x):
    return jax.nn.softplus(x) - math.log(2.0)


def dense(layer: eqx.nn.Linear, x):
    """An equinox Linear applied over any leading axes: (..., in) -> (..., out)."""
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def neighbour_list(pos, atom_mask, k: int | None, cutoff: float):
    """Neighbours of each atom of one padded graph: (index (A, K), distance (A, K), mask (A, K)).

    ``k``: the k nearest other real atoms (K = min(k, A - 1)), of which those beyond the cutoff are
    masked; ``None``: every other atom (K = A), masked beyond the cutoff. Masked entries carry the
    cutoff distance, where every filter is exactly zero.
    """
    a = pos.shape[0]
    diff = pos[:, None, :] - pos[None, :, :]  # (A, A, 3)
    valid = atom_mask[:, None] & atom_mask[None, :] & ~jnp.eye(a, dtype=bool)
    # sqrt of a positive value only, so no NaN gradient from the masked diagonal
    dist = jnp.sqrt(jnp.where(valid, jnp.sum(diff * diff, axis=-1), 1.0))  # (A, A)
    if k is None:
        index = jnp.broadcast_to(jnp.arange(a), (a, a))
        mask = valid & (dist < cutoff)
    else:
        score = jnp.where(valid, dist, jnp.inf)
        neg, index = jax.lax.top_k(-score, min(k, a - 1))
        dist = -neg
        mask = jnp.isfinite(dist) & (dist < cutoff)
    return index, jnp.where(mask, dist, cutoff), mask


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

    def __call__(self, x, rbf, envelope, index):
        """x (A, F); rbf (A, K, G); envelope (A, K) cutoff weights, 0 where masked; index (A, K)."""
        w = dense(self.filter_out, shifted_softplus(dense(self.filter_in, rbf))) * envelope[..., None]  # (A, K, W)
        messages = jnp.sum(dense(self.atom_in, x)[index] * w, axis=1)  # (A, W)
        return x + dense(self.update, shifted_softplus(dense(self.atom_out, messages)))


class SchNet(eqx.Module):
    """SchNet for one padded graph: ``model(z (A,), pos (A, 3), atom_mask (A,)) -> scalar``.

    Batches are ``jax.vmap(model)(z, pos, atom_mask)``. The scalar is the sum of the atom outputs,
    in the units the caller normalises the target to.
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

    def atom_outputs(self, z, pos, atom_mask):
        """(A,) per-atom contributions, zero on padding."""
        c = self.config
        index, dist, mask = neighbour_list(pos, atom_mask, c.neighbours, c.cutoff)
        envelope = jnp.where(mask, 0.5 * (jnp.cos(jnp.pi * dist / c.cutoff) + 1.0), 0.0)  # (A, K)
        rbf = self.radial_basis(dist)  # (A, K, G)
        x = self.embedding.weight[z]  # (A, F)
        for block in self.interactions:
            x = block(x, rbf, envelope, index)
        out = dense(self.head_out, shifted_softplus(dense(self.head_hidden, x)))[:, 0]
        return jnp.where(atom_mask, out, 0.0)

    def __call__(self, z, pos, atom_mask):
        return jnp.sum(self.atom_outputs(z, pos, atom_mask))


def parameter_count(model: eqx.Module) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
