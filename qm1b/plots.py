"""``qm1b plot``: what a generated dataset looks like, as one PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .store import open_dataset


def plot_dataset(directory, path: str | Path | None = None) -> Path:
    """Histograms of the HOMO-LUMO gap and the energy per atom, and the convergence rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dataset = open_dataset(directory)
    arrays = dataset.arrays()
    cols = arrays.columns
    path = Path(path) if path is not None else Path(directory) / "dataset.png"
    failures = len(dataset.failures())
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    axes[0].hist(cols["y"], bins=30, color="tab:blue")
    axes[0].set_xlabel("HOMO-LUMO gap y (eV)")
    axes[0].set_ylabel("conformers")
    axes[1].hist(cols["energy"] / np.maximum(arrays.natoms, 1), bins=30, color="tab:orange")
    axes[1].set_xlabel("energy per atom (eV)")
    converged = int(np.sum(cols["converged"]))
    counts = [converged, len(arrays) - converged, failures]
    axes[2].bar(["converged", "not converged", "failed"], counts, color=["tab:green", "tab:red", "tab:gray"])
    for x, c in enumerate(counts):
        axes[2].text(x, c, str(c), ha="center", va="bottom")
    axes[2].set_ylim(0, 1.15 * max(counts) + 1)  # room for the labels
    rate = converged / len(arrays) if len(arrays) else 0.0
    axes[2].set_title(f"convergence rate {rate:.1%}")
    fig.suptitle(f"{directory}: {len(arrays)} conformers, {len(np.unique(cols['molecule_id']))} molecules")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
