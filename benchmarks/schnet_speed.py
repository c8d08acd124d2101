"""SchNet training throughput, side by side: ours (JAX) against torch_geometric's SchNet (CPU torch).

    pip install -e .[bench]          # torch 2.13.0 (CPU) and torch-geometric
    python benchmarks/schnet_speed.py [--windows 5] [--steps 20] [--configs small,schnet-9m]

Both sides train the same configuration (features, filters, interactions, Gaussians, cutoff, 28
neighbours; parameter counts printed and equal) on the same batches of 32 QM9 molecules (a random
subset, packed by our batcher; torch gets the same molecules): forward, L1 loss, backward, AdamW.

- torch: ``torch.set_num_threads(2)`` and ``torch.set_flush_denormal(True)`` (docs/benchmarking.md: the
  Gaussian expansion makes denormals that slow CPU torch 3-4x). torch_geometric's own radius graph
  needs pyg-lib or torch-cluster, which PyPI does not serve as wheels here, so its SchNet gets an
  ``interaction_graph`` in plain torch (dense distances within each molecule, the 28 nearest within
  the cutoff): the same neighbours as ours.
- JAX: XLA's default CPU thread pool, float32 as torch. Denormals do not slow XLA here: measured
  on this machine, a jitted float32 (2048, 512) x (512, 512) matmul with tanh/exp takes 8.3 ms with
  operands of 1e-40 (denormal) as with 1e-3, so nothing needs flushing on this side.

Windows alternate ours, torch, ours, torch, ... (``--steps`` steps each, after a warm-up); a window
whose 1-minute load average is above ``--busy-load`` is dropped as noisy, and the kept count is
printed. Molecules per second are medians over the kept windows with [min-max]; the ratio is the
median of the per-window ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import equinox as eqx
import jax
import numpy as np
from common import median_range

from schnet.config import CONFIGS
from schnet.data import pair_count, layout_for, load_qm9, pack, pad_batch
from schnet.model import SchNet, parameter_count
from schnet.train import Normaliser, TrainConfig, make_train_step, optimizer


def torch_side(config, batches_of_graphs, graphs, steps_per_window):
    import torch
    from torch_geometric.nn.models import SchNet as PygSchNet

    torch.set_num_threads(2)
    torch.set_flush_denormal(True)

    def interaction_graph(pos, batch):
        """The k nearest atoms of the same molecule within the cutoff (dense, plain torch)."""
        dist = torch.cdist(pos, pos)
        same = (batch[:, None] == batch[None, :]) & ~torch.eye(len(pos), dtype=torch.bool)
        dist = dist.masked_fill(~same, float("inf"))
        k = min(config.neighbours, len(pos) - 1)
        near, index = torch.topk(dist, k, dim=1, largest=False)
        keep = near < config.cutoff
        target = torch.arange(len(pos))[:, None].expand(-1, k)[keep]
        source = index[keep]
        edge_index = torch.stack([source, target])
        return edge_index, near[keep]

    model = PygSchNet(hidden_channels=config.features, num_filters=config.filters,
                      num_interactions=config.interactions, num_gaussians=config.gaussians, cutoff=config.cutoff,
                      interaction_graph=interaction_graph, max_num_neighbors=config.neighbours)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    data = []
    for chunk in batches_of_graphs:
        atoms = graphs.atom_indices(chunk)
        data.append((torch.as_tensor(graphs.z[atoms], dtype=torch.long), torch.as_tensor(graphs.pos[atoms]),
                     torch.as_tensor(np.repeat(np.arange(len(chunk)), graphs.natoms[chunk])),
                     torch.as_tensor(graphs.target[chunk], dtype=torch.float32)))  # fmt: skip
    count = sum(p.numel() for p in model.parameters())

    def window(start):
        molecules = 0
        t = time.perf_counter()
        for i in range(steps_per_window):
            z, pos, batch, y = data[(start + i) % len(data)]
            opt.zero_grad()
            loss = (model(z, pos, batch).squeeze(-1) - y).abs().mean()
            loss.backward()
            opt.step()
            molecules += len(y)
        return molecules / (time.perf_counter() - t)

    return window, count


def jax_side(config, batches_of_graphs, graphs, layout, steps_per_window):
    model = SchNet(config, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optimizer(TrainConfig(learning_rate=5e-4, warmup_steps=1))
    step = make_train_step(tx, static, Normaliser(float(graphs.target.mean()), float(graphs.target.std())), layout)
    data = [pad_batch(graphs, chunk, layout) for chunk in batches_of_graphs]
    state = [params, tx.init(params)]

    def window(start):
        molecules = 0
        t = time.perf_counter()
        for i in range(steps_per_window):
            batch = data[(start + i) % len(data)]
            state[0], state[1], loss, _ = step(state[0], state[1], batch)
            molecules += int(batch.graph_mask.sum())
        jax.block_until_ready(loss)
        return molecules / (time.perf_counter() - t)

    return window, parameter_count(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="small,schnet-9m")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="training steps per window")
    parser.add_argument("--molecules", type=int, default=3200, help="random QM9 molecules to draw batches from")
    parser.add_argument("--busy-load", type=float, default=2.5)
    args = parser.parse_args()
    everything = load_qm9()
    graphs = everything.take(np.random.default_rng(0).permutation(len(everything))[: args.molecules])
    print(f"{args.molecules} random QM9 molecules, batches of 32; torch 2 threads + flush denormals; XLA default\n")
    print(f"{'config':10s} {'parameters':>12s} | {'ours mol/s':>22s} | {'torch_geometric mol/s':>22s} | {'ratio':>5s} | windows kept")
    for name in args.configs.split(","):
        config = CONFIGS[name]
        pairs = pair_count(graphs, config.neighbours, config.cutoff)
        layout = layout_for(graphs, pairs, 32)
        chunks = pack(np.random.default_rng(1).permutation(len(graphs)), graphs, pairs, layout)
        ours, ours_params = jax_side(config, chunks, graphs, layout, args.steps)
        theirs, their_params = torch_side(config, chunks, graphs, args.steps)
        ours(0), theirs(0)  # warm-up: compilation, allocator
        kept, dropped = [], 0
        for w in range(args.windows):
            load = os.getloadavg()[0]
            a, b = ours(w * args.steps), theirs(w * args.steps)
            if load > args.busy_load:
                dropped += 1
                continue
            kept.append((a, b))
        if not kept:
            print(f"{name:10s} every window was busy (load > {args.busy_load}); rerun on a quieter machine")
            continue
        ratios = [a / b for a, b in kept]
        ours_rate, their_rate = median_range([a for a, _ in kept], ".0f"), median_range([b for _, b in kept], ".0f")
        print(f"{name:10s} {ours_params:>12,d} | {ours_rate:>22s} | {their_rate:>22s} | "
              f"{statistics.median(ratios):5.2f} | {len(kept)} of {args.windows}"
              + ("" if ours_params == their_params else f"  (torch has {their_params:,} parameters)"))  # fmt: skip
    print("\nratio = ours / torch_geometric molecules per second (median of per-window ratios); > 1: ours faster")


if __name__ == "__main__":
    main()
