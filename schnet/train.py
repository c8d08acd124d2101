"""Training: AdamW with linear warm-up and exponential decay, L1 loss on the normalised gap.

The anchor schedule (QM1B's baseline) is lr 5e-4, 2,500 warm-up steps, then x0.96 every 9,600
steps; :class:`TrainConfig` holds these, and shorter runs scale them. The target is normalised by
the training set's mean and standard deviation; the model predicts (y - mean) / std as a sum over
atoms. Validation MAE is in meV.

A run directory holds ``metrics.csv`` (step, train loss, validation MAE), ``checkpoint.eqx`` and
``learning_curve.png``. The checkpoint is one file: a JSON header (step, normaliser, batch layout,
configs: what ``--resume`` needs to continue exactly, batches included), then the model and
optimizer state (``eqx.tree_serialise_leaves``). It is written to a temporary name, synced and
renamed, so a crash leaves the previous checkpoint or the new one, never half of one or a mix.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pyscf_ipu.config import option
from pyscf_ipu.programs import full_precision

from .config import SchNetConfig, get_config
from .data import Batch, GraphSet, Layout, batches, pair_count, layout_for, pack, pad_batch, split_by_group
from .model import SchNet, parameter_count
from .plots import plot_learning_curve

DATA_AXIS = "data"
CHECKPOINT = "checkpoint.eqx"
METRICS = "metrics.csv"


@dataclass(frozen=True)
class TrainConfig:
    """One training run; the CLI's options are generated from these fields."""

    config: str = option("small", "model configuration: schnet-9m, small or tiny")
    data: str = option("qm9", "qm9, a qm1b dataset directory, or a QM1B-format Parquet file")
    out: str = option("runs/schnet", "run directory (metrics, checkpoints, learning curve)", metavar="DIR")
    steps: int = option(1000, "optimizer steps")
    batch_size: int = option(32, "graphs per batch (over all devices)")
    devices: int | None = option(None, "data-parallel over this many local devices (default: all of them)")
    num_train: int | None = option(None, "training graphs (default: all not in validation); for scaling runs")
    num_val: int = option(2000, "validation graphs (whole molecules: split by SMILES)")
    limit: int | None = option(None, "read at most this many graphs from the data")
    learning_rate: float = option(5e-4, "peak learning rate (AdamW)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int | None = option(None, "linear warm-up steps (default: 2,500, or a tenth of --steps if less)")
    decay_steps: int = option(9600, "the rate is multiplied by decay_rate every this many steps")
    decay_rate: float = option(0.96, "exponential decay factor")
    val_every: int = option(500, "evaluate the validation MAE every this many steps")
    seed: int = option(0, "seed of the split, the initial parameters and the batch order")
    resume: bool = option(False, "continue the run in --out from its last checkpoint")
    progress: bool = option(True, "show a progress bar")

    def __post_init__(self) -> None:
        get_config(self.config)
        for name in ("steps", "batch_size", "num_val", "val_every", "decay_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.devices is not None and (self.devices < 1 or self.batch_size % self.devices):
            raise ValueError(f"--batch-size {self.batch_size} must split evenly over --devices {self.devices}")

    @property
    def warmup(self) -> int:
        """The default warm-up: the anchor's 2,500 steps, scaled down for short runs."""
        return min(2500, max(self.steps // 10, 1))

    @property
    def device_count(self) -> int:
        """The devices a run uses: --devices, or every local device."""
        available = jax.local_device_count()
        if self.devices is not None and self.devices > available:
            raise ValueError(f"--devices {self.devices}: only {available} local devices")
        count = self.devices or available
        if self.batch_size % count:
            raise ValueError(f"--batch-size {self.batch_size} does not split evenly over {count} devices")
        return count


@dataclass(frozen=True)
class Normaliser:
    mean: float
    std: float


def optimizer(train: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_exponential_decay_schedule(
        init_value=0.0,
        peak_value=train.learning_rate,
        warmup_steps=train.warmup if train.warmup_steps is None else train.warmup_steps,
        transition_steps=train.decay_steps,
        decay_rate=train.decay_rate,
    )
    return optax.adamw(schedule, weight_decay=train.weight_decay)


def normalised_output(model: SchNet, batch: Batch, layout: Layout):
    """((B,) model outputs, the neighbour pairs the batch wanted)."""
    return model(batch.z, batch.pos, batch.atom_mask, batch.graph_index, batch.target.shape[0], layout.pairs,
                 layout.graph_atoms)  # fmt: skip


def error_sum(model: SchNet, batch: Batch, norm: Normaliser, layout: Layout):
    """(sum of |error| of the normalised target over the real graphs of the batch, pairs wanted).

    Times ``norm.std`` it is the sum of |error| in eV.
    """
    out, wanted = normalised_output(model, batch, layout)
    error = jnp.abs(out - (batch.target - norm.mean) / norm.std)
    return jnp.sum(jnp.where(batch.graph_mask, error, 0.0)), wanted


def l1_loss(model: SchNet, batch: Batch, norm: Normaliser, layout: Layout):
    """(mean |error| of the normalised target over the real graphs of the batch, pairs wanted)."""
    total, wanted = error_sum(model, batch, norm, layout)
    return total / jnp.maximum(jnp.sum(batch.graph_mask), 1), wanted


def make_train_step(tx: optax.GradientTransformation, static: SchNet, norm: Normaliser, layout: Layout,
                    devices: int = 1):  # fmt: skip
    """A jitted step (params, opt_state, batch) -> (params, opt_state, loss, pairs wanted); compiles once.

    ``devices > 1``: data parallel over that many local devices (``shard_map``); the batch then has
    a leading device axis (see :func:`device_batches`), each device computes its graphs' error sum
    and gradient, and both are summed over devices and divided by the global graph count: the
    same loss and gradient as one device on the union of the device batches.
    """

    def body(params, opt_state, batch: Batch, axis: str | None):
        reduce = (lambda x: jax.lax.psum(x, axis)) if axis else (lambda x: x)

        def loss_sum(p):
            return error_sum(eqx.combine(p, static), batch, norm, layout)

        (total, wanted), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
        count = jnp.maximum(reduce(jnp.sum(batch.graph_mask)), 1)
        grads = jax.tree.map(lambda g: reduce(g) / count, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        wanted = jax.lax.pmax(wanted, axis) if axis else wanted
        return optax.apply_updates(params, updates), opt_state, reduce(total) / count, wanted

    if devices == 1:
        return jax.jit(full_precision(lambda params, opt_state, batch: body(params, opt_state, batch, None)))
    mesh = Mesh(np.asarray(jax.local_devices()[:devices]), (DATA_AXIS,))
    sharded = jax.shard_map(
        lambda params, opt_state, batch: body(params, opt_state, jax.tree.map(lambda x: x[0], batch), DATA_AXIS),
        mesh=mesh,
        in_specs=(P(), P(), P(DATA_AXIS)),
        out_specs=P(),
        check_vma=False,
    )
    return jax.jit(full_precision(sharded))


def device_batches(stream, devices: int):
    """Stack ``devices`` consecutive batches along a new leading axis (one per device); unchanged for 1."""
    if devices == 1:
        yield from stream
        return
    while True:
        group = list(itertools.islice(stream, devices))
        if len(group) < devices:
            return
        yield jax.tree.map(lambda *leaves: np.stack(leaves), *group)


def make_eval_step(static: SchNet, norm: Normaliser, layout: Layout):
    """Jitted (params, batch) -> (sum of |error| in eV over real graphs, their count, pairs wanted)."""

    @jax.jit
    @full_precision
    def step(params, batch: Batch):
        total, wanted = error_sum(eqx.combine(params, static), batch, norm, layout)
        return norm.std * total, jnp.sum(batch.graph_mask), wanted

    return step


class PairBudgetError(RuntimeError):
    """A batch wanted more neighbour pairs than its layout holds (a bug: the batcher's counts are upper bounds)."""


def check_pairs(wanted: int, layout: Layout) -> None:
    if wanted > layout.pairs:
        raise PairBudgetError(f"a batch wanted {wanted} neighbour pairs, more than the layout's {layout.pairs}")


def mean_absolute_error(eval_step, params, graphs: GraphSet, indices, pairs: np.ndarray, layout: Layout) -> float:
    """MAE in eV over ``indices`` (one pass)."""
    total, count = 0.0, 0
    for batch in batches(graphs, indices, pairs, layout):
        s, c, wanted = eval_step(params, batch)
        check_pairs(int(wanted), layout)
        total, count = total + float(s), count + int(c)
    return total / max(count, 1)


def predict(model: SchNet, state: "RunState", graphs: GraphSet, indices) -> np.ndarray:
    """The model's targets (eV) for graphs ``indices``, in that order (one pass, the run's batch layout)."""
    params, static = eqx.partition(model, eqx.is_array)
    layout, norm = state.layout, state.norm

    @jax.jit
    @full_precision
    def step(params, batch: Batch):
        out, wanted = normalised_output(eqx.combine(params, static), batch, layout)
        return norm.mean + norm.std * out, wanted

    pairs = pair_count(graphs, model.config.neighbours, model.config.cutoff)
    out = []
    for chunk in pack(np.asarray(indices, np.int64), graphs, pairs, layout):
        values, wanted = step(params, pad_batch(graphs, chunk, layout))
        check_pairs(int(wanted), layout)
        out.append(np.asarray(values)[: len(chunk)])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


@dataclass
class RunState:
    """What a checkpoint restores besides the arrays."""

    step: int
    norm: Normaliser
    layout: Layout
    model: dict
    train: dict
    split_sizes: dict = field(default_factory=dict)


CHECKPOINT_MAGIC = b"schnet-checkpoint-2\n"  # 2: Layout counts neighbour pairs, not edges


def _save(out: Path, params, opt_state, state: RunState) -> None:
    """One file, replaced atomically: the RunState (JSON) as a header, then the arrays.

    Arrays and state in one file cannot disagree after a crash, as two separately replaced files
    could (a new step's parameters with the previous step's data position).
    """
    header = json.dumps(dataclasses.asdict(state)).encode()
    tmp = out / (CHECKPOINT + ".tmp")
    with tmp.open("wb") as handle:
        handle.write(CHECKPOINT_MAGIC + len(header).to_bytes(8, "little") + header)
        eqx.tree_serialise_leaves(handle, (params, opt_state))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, out / CHECKPOINT)


def _open_checkpoint(out: Path):
    """(open file positioned at the arrays, RunState) of a run directory's checkpoint."""
    path = out / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"{out} holds no SchNet checkpoint ({CHECKPOINT} missing)")
    handle = path.open("rb")
    if handle.read(len(CHECKPOINT_MAGIC)) != CHECKPOINT_MAGIC:
        handle.close()
        raise ValueError(f"{path} is not a checkpoint of this version of schnet")
    raw = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return handle, RunState(**{**raw, "norm": Normaliser(**raw["norm"]), "layout": Layout(**raw["layout"])})


def read_state(out: Path) -> RunState:
    """The RunState of a run directory's last checkpoint."""
    handle, state = _open_checkpoint(out)
    handle.close()
    return state


def _read_arrays(out: Path, like):
    """The checkpoint's (params, opt_state), shaped like ``like``."""
    handle, _ = _open_checkpoint(out)
    with handle:
        return eqx.tree_deserialise_leaves(handle, like)


def load_run(out: str | Path):
    """(model, RunState) of a run directory's last checkpoint."""
    out = Path(out)
    state = read_state(out)
    model = SchNet(SchNetConfig(**state.model), key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optimizer(TrainConfig(**state.train))
    params, _ = _read_arrays(out, (params, tx.init(params)))
    return eqx.combine(params, static), state


def _write_metrics(path: Path, rows: list[dict]) -> None:
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "train_loss_mev", "val_mae_mev", "seconds"])
        if handle.tell() == 0:
            writer.writeheader()
        writer.writerows(rows)


def read_metrics(out: str | Path) -> list[dict]:
    """The rows of a run directory's metrics CSV (strings, as written), [] before its first evaluation."""
    path = Path(out) / METRICS
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def final_validation_mae(rows: list[dict], last: int = 3) -> float:
    """The mean of the last ``last`` validation MAEs (meV): the QM9 learning benchmark's figure."""
    return float(np.mean([float(r["val_mae_mev"]) for r in rows[-last:]]))


def train(train_config: TrainConfig, graphs: GraphSet) -> dict:
    """Train (or resume) a run; returns the summary with the final validation MAE in meV."""
    from tqdm import tqdm

    out = Path(train_config.out)
    split = split_by_group(graphs, val=train_config.num_val, train=train_config.num_train, seed=train_config.seed)
    model_config = get_config(train_config.config)
    pairs = pair_count(graphs, model_config.neighbours, model_config.cutoff)  # (n,) per graph
    if train_config.resume:
        state = read_state(out)
        model = SchNet(SchNetConfig(**state.model), key=jax.random.key(0))  # parameters: from the checkpoint below
        free = ("steps", "resume", "progress", "val_every")  # what a resumed run may change
        changed = [k for k, v in dataclasses.asdict(train_config).items() if k not in free and state.train.get(k) != v]
        if changed:
            raise ValueError(f"--resume with other settings ({', '.join(changed)}) would not continue the same run")
        norm, start, layout = state.norm, state.step, state.layout
    else:
        if (out / CHECKPOINT).exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
        targets = graphs.target[split["train"]]
        norm = Normaliser(float(targets.mean()), float(targets.std()) or 1.0)
        model = SchNet(model_config, key=jax.random.key(train_config.seed))
        start = 0
        layout = layout_for(graphs, pairs, train_config.batch_size // train_config.device_count)  # per device
    out.mkdir(parents=True, exist_ok=True)
    tx = optimizer(train_config)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = tx.init(params)
    if train_config.resume:
        params, opt_state = _read_arrays(out, (params, opt_state))
    devices = train_config.device_count
    step_fn, eval_fn = make_train_step(tx, static, norm, layout, devices), make_eval_step(static, norm, layout)
    state = RunState(start, norm, layout, dataclasses.asdict(model.config),
                     {**dataclasses.asdict(train_config), "resume": False},
                     {k: len(v) for k, v in split.items()})  # fmt: skip

    stream = device_batches(batches(graphs, split["train"], pairs, layout, seed=train_config.seed, start=start * devices),
                            devices)  # fmt: skip
    size = train_config.batch_size
    bar = tqdm(total=train_config.steps * size, initial=start * size, disable=not train_config.progress, unit="mol")
    t0, running, rows, val_mae, wanted = time.perf_counter(), [], [], None, jnp.zeros((), jnp.int32)
    for step in range(start, train_config.steps):
        batch = next(stream)
        params, opt_state, loss, batch_wanted = step_fn(params, opt_state, batch)
        running.append(loss)
        wanted = jnp.maximum(wanted, batch_wanted)  # checked at each evaluation, without a sync per step
        done = step + 1
        if done % train_config.val_every == 0 or done == train_config.steps:
            check_pairs(int(wanted), layout)
            train_mae = float(np.mean(jax.device_get(running))) * norm.std * 1000
            val_mae = 1000 * mean_absolute_error(eval_fn, params, graphs, split["val"], pairs, layout)
            rows.append({"step": done, "train_loss_mev": f"{train_mae:.3f}", "val_mae_mev": f"{val_mae:.3f}",
                         "seconds": f"{time.perf_counter() - t0:.1f}"})  # fmt: skip
            state.step = done
            _save(out, params, opt_state, state)  # before the metrics: a crash between them repeats no row
            _write_metrics(out / METRICS, rows)
            rows, running = [], []
            bar.set_postfix(val_mae_mev=f"{val_mae:.1f}")
        bar.update(size)
    bar.close()
    if val_mae is None:  # resumed at or past --steps: nothing new to evaluate
        val_mae = float(read_metrics(out)[-1]["val_mae_mev"])
    plot_learning_curve(read_metrics(out), out / "learning_curve.png")
    return {
        "val_mae_mev": val_mae,
        "steps": train_config.steps,
        "parameters": parameter_count(eqx.combine(params, static)),
        "train": len(split["train"]),
        "val": len(split["val"]),
        "seconds": time.perf_counter() - t0,
        "out": str(out),
    }
