"""Data scaling: one SchNet config trained on growing training sets; validation MAE against size, log-log.

    python benchmarks/scaling.py [--data qm9|DIR|FILE.parquet] [--config small] [--sizes 1000,4000,16000,64000]
                                 [--steps 20000] [--num-val 2000] [--out runs/scaling]

Like the QM1B paper's scaling figure (a plain SchNet keeps improving with more data: about 290 meV
at 100k examples, 82 at 1M, 40 at 10M, 32 at 100M). Every size uses the same validation molecules
(split by molecule, seed 0) and the same number of steps; a run that already finished (its run
directory exists) is read back, not retrained, so the script can be stopped and restarted. The
figure is written to OUT/scaling.png and the table to OUT/scaling.csv.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from schnet.data import load, split_by_group
from schnet.plots import plot_scaling
from schnet.train import CHECKPOINT, TrainConfig, final_validation_mae, read_metrics, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="qm9")
    parser.add_argument("--config", default="small")
    parser.add_argument("--sizes", default="1000,4000,16000,64000")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--num-val", type=int, default=2_000)
    parser.add_argument("--val-every", type=int, default=1_000)
    parser.add_argument("--out", default="runs/scaling")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graphs = load(args.data)
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) + args.num_val > len(graphs):
        raise SystemExit(f"error: {args.data} has {len(graphs)} graphs, fewer than {max(sizes)} + {args.num_val}")
    results = []
    for size in sizes:
        run = out / f"{args.config}-{size}"
        started = (run / CHECKPOINT).exists()
        rows = read_metrics(run)
        if not started or not rows or int(rows[-1]["step"]) < args.steps:
            config = TrainConfig(config=args.config, data=args.data, out=str(run), steps=args.steps, num_train=size,
                                 num_val=args.num_val, val_every=args.val_every, resume=started)  # fmt: skip
            train(config, graphs)
        split = split_by_group(graphs, val=args.num_val, train=size, seed=0)
        results.append((len(split["train"]), final_validation_mae(read_metrics(run))))
        print(f"{args.config}: {results[-1][0]:>7,d} training graphs -> validation MAE {results[-1][1]:.1f} meV")

    with (out / "scaling.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([("train_graphs", "val_mae_mev"), *results])
    plot_scaling(results, out / "scaling.png", label=f"{args.config}, {args.steps:,} steps")
    print(f"wrote {out / 'scaling.png'} and {out / 'scaling.csv'}")


if __name__ == "__main__":
    main()
