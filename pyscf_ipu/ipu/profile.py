"""The profile of a tile plan: a JSON report, a readable summary and a PopVision-like tile map."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .plan import TilePlan

TIME_FORMULA = (
    "t_JK = (max_tile(items) * cycles_per_item + 2 * sync_cycles) / clock_hz"
    " + output_exchange_bytes / exchange_bytes_per_s + link_bytes / ipu_link_bytes_per_s"
    " + [num_ipus > 1] * link_sync_seconds;"
    " t_iteration = t_JK + input_broadcast_bytes / exchange_bytes_per_s + sync_cycles / clock_hz"
)


def profile_report(plan: TilePlan, iterations: int) -> dict:
    """Every number of the plan that a person would ask for, with the model's assumptions."""
    used_bytes = plan.tile_bytes[plan.used]
    w = plan.workload
    return {
        "strategy": plan.strategy.name,
        "work_item": plan.strategy.item,
        "ipus_used": plan.num_ipus,
        "tiles_per_ipu": plan.model.tiles,
        "tiles_used": plan.tiles_used,
        "bytes_per_tile": {
            "min": int(used_bytes.min()),
            "mean": float(used_bytes.mean()),
            "max": int(used_bytes.max()),
            "budget": plan.model.budget_bytes,
            "by_category_max": {k: int(v.max()) for k, v in plan.memory.items()},
        },
        "total_bytes": plan.total_bytes,
        "items_per_tile": {"min": int(plan.items[plan.used].min()), "max": plan.max_items},
        "load_imbalance": plan.imbalance,
        "nao": w.nao,
        "eri_unique_total": w.unique_total,
        "eri_unique_kept": w.unique_integrals,
        "eri_sparsity": w.sparsity,
        "exchange_bytes_per_iteration": {
            "input_broadcast": plan.input_bytes,
            "output": plan.output_bytes,
            "ipu_links": plan.link_bytes,
            "total": plan.exchange_bytes_per_iteration,
        },
        "estimate": {
            "compute_cycles_per_jk": plan.compute_cycles,
            "seconds_per_jk": plan.jk_seconds,
            "seconds_per_iteration": plan.iteration_seconds,
            "iterations": iterations,
            "seconds_all_iterations": plan.iteration_seconds * iterations,
            "formula": TIME_FORMULA,
        },
        "assumptions": plan.model.assumptions(),
        "tile_bytes": plan.tile_bytes.tolist(),  # (ipus, tiles): the tile map
    }


def summary_lines(report: dict) -> list[str]:
    b, e, x = report["bytes_per_tile"], report["estimate"], report["exchange_bytes_per_iteration"]
    model = report["assumptions"]
    return [
        f"IPU      {report['strategy']} strategy on {report['ipus_used']} x {model['name']} IPU, "
        f"{report['tiles_used']} of {report['tiles_per_ipu'] * report['ipus_used']} tiles used, "
        f"load imbalance {report['load_imbalance']:.3f}",
        f"         bytes per tile min/mean/max {b['min']:,} / {b['mean']:,.0f} / {b['max']:,} "
        f"(budget {b['budget']:,}); ERI {report['eri_unique_kept']:,} unique kept "
        f"(sparsity {report['eri_sparsity']:.1%})",
        f"         exchange {x['total']:,} bytes per iteration; modelled {e['compute_cycles_per_jk']:,.0f} cycles, "
        f"{e['seconds_per_jk'] * 1e6:.2f} us per J-K build, {e['seconds_per_iteration'] * 1e6:.2f} us per iteration",
    ]


def tile_grid(values: np.ndarray, columns: int = 32) -> np.ndarray:
    """(tiles,) -> (rows, columns), padded with NaN, laid out like PopVision's tile view."""
    rows = -(-values.size // columns)
    grid = np.full(rows * columns, np.nan)
    grid[: values.size] = values
    return grid.reshape(rows, columns)


def plot_tile_map(report: dict, path: str | Path) -> Path:
    """A heatmap of memory per tile (KiB) from a profile report, one panel per IPU; idle tiles grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    kib = np.asarray(report["tile_bytes"], float) / 1024  # (ipus, tiles)
    budget = report["bytes_per_tile"]["budget"] / 1024
    ipus = kib.shape[0]
    cols = min(ipus, 4)
    rows = -(-ipus // cols)
    cmap = plt.get_cmap("viridis").with_extremes(bad="lightgrey")  # idle tiles, the grid's padding
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.0 * cols + 1.6, 3.6 * rows + 0.8), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[ipus:]:
        ax.set_axis_off()
    for ipu, ax in enumerate(axes.flat[:ipus]):
        grid = tile_grid(np.where(kib[ipu] > 0, kib[ipu], np.nan))
        image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=max(kib.max(), 1e-3), aspect="auto")
        ax.set_title(f"IPU {ipu}: {int(np.count_nonzero(kib[ipu]))} tiles used", fontsize=9)
        ax.set_xlabel("tile % 32")
        ax.set_ylabel("tile // 32")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="KiB per tile (grey: idle)")
    fig.suptitle(
        f"{report['strategy']} plan, {report['nao']} AOs, load imbalance {report['load_imbalance']:.2f}\n"
        f"fullest tile {kib.max():.1f} KiB = "
        f"{kib.max() / budget:.0%} of the {budget:.0f} KiB budget",
        fontsize=9,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
