"""``schnet-train`` and ``schnet-eval``.

    schnet-train --config small --data qm9|DIR|FILE.parquet --steps N --out RUN_DIR [options]
    schnet-eval --run RUN_DIR --data qm9|DIR|FILE.parquet --split val

Bad input (unknown config, unreadable data, an existing run without --resume, a run directory
without a checkpoint) prints one line naming the problem and exits with code 2.
"""

from __future__ import annotations

import json
import sys

from pyscf_ipu.cli import EXIT_BAD_INPUT, Parser, reports_missing_extras
from pyscf_ipu.config import add_config_arguments, config_from_arguments


@reports_missing_extras("schnet-train")
def train_main(argv: list[str] | None = None) -> int:
    from .train import TrainConfig

    parser = Parser(prog="schnet-train", description="train SchNet on the HOMO-LUMO gap")
    add_config_arguments(parser, TrainConfig)
    args = parser.parse_args(argv)
    try:
        config = config_from_arguments(args, TrainConfig)
        from .data import load
        from .train import train

        summary = train(config, load(config.data, config.limit))
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as err:
        print(f"schnet-train: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"final validation MAE {summary['val_mae_mev']:.1f} meV after {summary['steps']} steps "
          f"({summary['parameters']:,} parameters, {summary['train']} training / {summary['val']} validation graphs, "
          f"{summary['seconds']:.0f} s); run in {summary['out']}")  # fmt: skip
    return 0


@reports_missing_extras("schnet-eval")
def eval_main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="schnet-eval", description="MAE of a trained SchNet run on a data split")
    parser.add_argument("--run", required=True, metavar="RUN_DIR")
    parser.add_argument("--data", default=None, help="default: the run's own data")
    parser.add_argument("--split", choices=("train", "val", "all"), default="val")
    args = parser.parse_args(argv)
    try:
        import equinox as eqx
        import numpy as np

        from .data import pair_count, load, split_by_group
        from .train import TrainConfig, load_run, make_eval_step, mean_absolute_error

        model, state = load_run(args.run)
        train_config = TrainConfig(**state.train)
        graphs = load(args.data or train_config.data, train_config.limit)
        if args.split == "all":
            indices = np.arange(len(graphs))
        else:  # the run's own split: same seed and sizes
            indices = split_by_group(graphs, val=train_config.num_val, train=train_config.num_train,
                                     seed=train_config.seed)[args.split]  # fmt: skip
        params, static = eqx.partition(model, eqx.is_array)
        pairs = pair_count(graphs, model.config.neighbours, model.config.cutoff)
        mae = mean_absolute_error(make_eval_step(static, state.norm, state.layout), params, graphs, indices, pairs,
                                  state.layout)  # fmt: skip
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"schnet-eval: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps({"mae_ev": mae, "count": int(len(indices))}))
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
