"""SchNet learning benchmark on QM9: the `small` config on 10k molecules, validated on 2k, 30,000 steps.

    python benchmarks/qm9_learning.py [--steps 30000] [--num-train 10000] [--num-val 2000] [--out runs/qm9-small]

A random subset (seed 0) of QM9's 130,831 molecules (QM9's own order grows in size), split by
molecule; AdamW with the anchor schedule (lr 5e-4, 2,500 warm-up steps, x0.96 every 9,600 steps),
batch 32, L1 loss; validation MAE on the HOMO-LUMO gap every 1,000 steps. Prints the curve, the
mean of the last three evaluations (the acceptance figure: at most 180 meV), the wall time, and
the baselines: predicting the training mean (computed here) and torch_geometric's SchNet with the
same sizes (measured on this machine, docs/benchmarking.md: 178 meV after about 24 minutes).
XLA uses its default CPU thread pool.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from schnet.data import load_qm9, split_by_group
from schnet.train import TrainConfig, final_validation_mae, read_metrics, train

TORCH_GEOMETRIC_MEV, TORCH_GEOMETRIC_MINUTES = 178.0, 24.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--num-train", type=int, default=10_000)
    parser.add_argument("--num-val", type=int, default=2_000)
    parser.add_argument("--val-every", type=int, default=1_000)
    parser.add_argument("--out", default="runs/qm9-small")
    args = parser.parse_args()

    t = time.perf_counter()
    everything = load_qm9()
    subset = everything.take(np.random.default_rng(0).permutation(len(everything))[: args.num_train + args.num_val])
    print(f"QM9: {len(everything):,} molecules read in {time.perf_counter() - t:.0f} s; "
          f"{len(subset):,} drawn at random (seed 0); load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    config = TrainConfig(config="small", out=args.out, steps=args.steps, num_train=args.num_train,
                         num_val=args.num_val, val_every=args.val_every, batch_size=32)  # fmt: skip
    split = split_by_group(subset, val=config.num_val, train=config.num_train, seed=config.seed)
    mean_mae = 1000 * np.mean(np.abs(subset.target[split["val"]] - subset.target[split["train"]].mean()))
    summary = train(config, subset)

    rows = read_metrics(args.out)
    print(f"\n{'step':>6s} {'train MAE meV':>14s} {'val MAE meV':>12s} {'seconds':>8s}")
    for r in rows:
        print(f"{r['step']:>6s} {r['train_loss_mev']:>14s} {r['val_mae_mev']:>12s} {r['seconds']:>8s}")
    last3 = final_validation_mae(rows)
    minutes = summary["seconds"] / 60
    print(f"\nsmall ({summary['parameters']:,} parameters), {summary['train']:,} train / {summary['val']:,} val molecules, "
          f"{args.steps:,} steps of 32: validation MAE {last3:.1f} meV (mean of the last three evaluations), "
          f"{minutes:.1f} min wall, {args.steps * 32 / summary['seconds']:.0f} molecules/s with evaluations; "
          f"load average at the end {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"baselines: predicting the training mean {mean_mae:.0f} meV; torch_geometric SchNet (same sizes, "
          f"docs/benchmarking.md) {TORCH_GEOMETRIC_MEV:.0f} meV in about {TORCH_GEOMETRIC_MINUTES:.0f} min")  # fmt: skip
    print(f"target: at most 180 meV: {'met' if last3 <= 180 else 'NOT met'}; learning curve: {args.out}/learning_curve.png")


if __name__ == "__main__":
    main()
