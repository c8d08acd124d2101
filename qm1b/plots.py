"""``qm1b plot``: what a generated dataset looks like, as one PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyscf_ipu.figures import new_figure, save_png

from .store import open_dataset


def plot_dataset(directory, path: str | Path | None = None) -> Path:
    """Histograms of the HOMO-LUMO gap and the energy per atom, and the convergence rate."""
    dataset = open_dataset(directory)
    arrays = dataset.arrays()
    cols = arrays.columns
    path = Path(path) if path is not None else Path(directory) / "dataset.png"
    failures = len(dataset.failures())
    trajectories = relaxation_energies(dataset)
    fig, (axes,) = new_figure(ncols=4 if trajectories else 3, size=(17.5 if trajectories else 13, 3.8))
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
    if trajectories:
        plot_relaxations(axes[3], trajectories)
    fig.suptitle(f"{directory}: {len(arrays)} conformers, {len(np.unique(cols['molecule_id']))} molecules")
    return save_png(fig, path)


RELAXATIONS_DRAWN = 40  # conformers whose energy-against-step lines the panel draws at most


def relaxation_energies(dataset) -> dict[tuple[int, int], np.ndarray]:
    """Each relaxed conformer's energies (eV) by step, from the trajectory frames (--relax dft
    --trajectory); empty without frames."""
    steps: dict[tuple[int, int], dict[int, float]] = {}
    for batch in dataset.frames():
        c = batch.columns
        for mid, cid, step, energy in zip(c["molecule_id"], c["conformer_id"], c["step"], c["energy"]):
            steps.setdefault((int(mid), int(cid)), {})[int(step)] = float(energy)
    return {key: np.array([by_step[k] for k in sorted(by_step)]) for key, by_step in sorted(steps.items())}


def plot_relaxations(ax, trajectories: dict[tuple[int, int], np.ndarray]) -> None:
    """Energy above each conformer's lowest, in meV on a log scale, against the optimiser's step: how
    the batch's relaxations went down, and how many steps each took."""
    for energies in list(trajectories.values())[:RELAXATIONS_DRAWN]:
        above = (energies - energies.min()) * 1000.0  # meV
        ax.plot(np.arange(len(energies)), np.maximum(above, 1e-3), lw=1, alpha=0.7)
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("energy above the lowest (meV)")
    drawn = min(len(trajectories), RELAXATIONS_DRAWN)
    ax.set_title(f"relaxations: {drawn} of {len(trajectories)} conformers")


def plot_gap_by_conformer(directory, path: str | Path, molecule_id: int | None = None) -> Path:
    """The HOMO-LUMO gap of each conformer of one molecule (default: the one with most conformers).

    How much the label moves with geometry alone: the spread a model must learn from positions.
    """
    with open_dataset(directory) as dataset:
        molecules = dict(dataset.molecules())
    if not molecules:
        raise ValueError(f"{directory} has no records")
    if molecule_id is None:
        molecule_id = max(molecules, key=lambda m: (len(molecules[m]), -m))
    if molecule_id not in molecules:
        raise ValueError(f"molecule {molecule_id} has no records in {directory}")
    records = molecules[molecule_id]
    cols = records.columns
    fig, ((ax,),) = new_figure(size=(6, 3.8))
    converged = cols["converged"].astype(bool)
    ax.plot(cols["conformer_id"], cols["y"], color="0.6", zorder=1)
    ax.scatter(cols["conformer_id"][converged], cols["y"][converged], label="converged", zorder=2)
    if not converged.all():
        ax.scatter(cols["conformer_id"][~converged], cols["y"][~converged], marker="x", color="tab:red",
                   label="not converged", zorder=2)  # fmt: skip
    ax.set_xlabel("conformer")
    ax.set_ylabel("HOMO-LUMO gap y (eV)")
    ax.set_title(f"molecule {molecule_id}: {cols['smile'][0]}; spread {np.ptp(cols['y']) * 1000:.0f} meV")
    ax.legend()
    return save_png(fig, path)
