"""Pictures of a SchNet run: its learning curve and its predictions against the labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyscf_ipu.figures import new_figure, save_png


def plot_learning_curve(rows: list[dict], path: str | Path) -> Path:
    """Training (running) and validation MAE against step, log scale, from a run's metrics rows
    (``schnet.train.read_metrics``)."""
    fig, ((ax,),) = new_figure()
    for key, label in (("train_loss_mev", "train MAE (running)"), ("val_mae_mev", "validation MAE")):
        points = [(int(r["step"]), float(r[key])) for r in rows if r[key]]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "val_mae_mev" else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("HOMO-LUMO gap MAE (meV)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return save_png(fig, path)


def plot_predictions(true: np.ndarray, predicted: np.ndarray, path: str | Path, *, label: str = "validation") -> Path:
    """Predicted against true HOMO-LUMO gaps (eV), with the diagonal and the MAE."""
    true, predicted = np.asarray(true, float), np.asarray(predicted, float)
    mae = float(np.mean(np.abs(predicted - true))) if len(true) else float("nan")
    fig, ((ax,),) = new_figure(size=(5.0, 5.0))
    ax.scatter(true, predicted, s=8, alpha=0.6)
    lo, hi = (min(true.min(), predicted.min()), max(true.max(), predicted.max())) if len(true) else (0.0, 1.0)
    ax.plot([lo, hi], [lo, hi], color="k", linewidth=0.8)
    ax.set_aspect("equal")
    ax.set_xlabel("true gap (eV)")
    ax.set_ylabel("predicted gap (eV)")
    ax.set_title(f"{label}: {len(true)} molecules, MAE {1000 * mae:.0f} meV")
    return save_png(fig, path)


def plot_scaling(results: list[tuple[int, float]], path: str | Path, *, label: str) -> Path:
    """Validation MAE (meV) against training-set size, log-log: the QM1B paper's scaling figure."""
    fig, ((ax,),) = new_figure(size=(5.0, 4.0))
    ax.loglog(*zip(*results), marker="o", label=label)
    ax.set_xlabel("training graphs")
    ax.set_ylabel("validation MAE, HOMO-LUMO gap (meV)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_png(fig, path)
