"""The profile of a tile plan: a JSON report, a readable summary and a PopVision-like tile map."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..figures import new_figure, save_png
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
    lines = []
    if "eri_tiles" in report:
        r = report["eri_tiles"]
        lines.append(
            f"ERI      {r['quartets']:,} shell quartets on {r['tiles_used']} tiles of {r['ipus_used']} IPU(s), "
            f"load imbalance {r['load_imbalance']:.2f}, bytes per tile max {r['bytes_per_tile']['max']:,}; "
            f"modelled {r['estimate']['seconds_per_molecule'] * 1e6:.0f} us per molecule"
        )
    return lines + [
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
    from matplotlib import colormaps

    kib = np.asarray(report["tile_bytes"], float) / 1024  # (ipus, tiles)
    budget = report["bytes_per_tile"]["budget"] / 1024
    ipus = kib.shape[0]
    cols = min(ipus, 4)
    rows = -(-ipus // cols)
    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")  # idle tiles, the grid's padding
    fig, axes = new_figure(ncols=cols, nrows=rows, size=(3.0 * cols + 1.6, 3.6 * rows + 0.8))
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
    return save_png(fig, path, dpi=110)


def tile_owner_map(shape_plan: TilePlan, real_plan: TilePlan, eri_s8: np.ndarray, nao: int) -> dict[str, np.ndarray]:
    """Which tile holds which integrals, drawn on the (npair, npair) matrix of AO pairs.

    Returns panel title -> (npair, npair) array of global tile numbers (IPU * tiles per IPU + tile),
    NaN where no tile holds anything. ``rows`` strategy: a tile holds whole rows of the J matrix
    [(kl), (ij)] and of the K matrix [(il), (jk)], so one panel each, in bands. ``s8``: the unique
    non-zero integrals (lower triangle, PySCF's s8 order) are dealt out to the tiles in runs.
    """
    from ..packed import tril_unpack
    from .contract import row_source, tile_shape

    npair = nao * (nao + 1) // 2
    if shape_plan.strategy.name == "rows":
        _, tiles, slots = tile_shape(shape_plan)
        source = row_source(shape_plan)  # (num_ipus * T * L,) row of [MJ; MK] in each slot
        slot = np.flatnonzero(source >= 0)
        ipu, tile = np.divmod(slot // slots, tiles)
        owner = np.full(source.max() + 1, np.nan)
        owner[source[slot]] = ipu * shape_plan.model.tiles + tile
        npair_pad = len(owner) // 2  # rows of padded AOs' pairs come after the real ones
        panels = {"J rows (kl)": owner[:npair], "K rows (il)": owner[npair_pad : npair_pad + npair]}
        return {name: np.repeat(rows[:, None], npair, axis=1) for name, rows in panels.items()}
    kept = np.flatnonzero(eri_s8)
    per_tile = real_plan.items.reshape(-1)  # items of each global tile, in placement order
    owner = np.repeat(np.arange(per_tile.size), per_tile)
    p, q = tril_unpack(kept)
    image = np.full((npair, npair), np.nan)
    image[p, q] = owner[: len(kept)]
    return {"unique integrals (ij|kl), ij >= kl": image}


def plot_tile_owners(maps: dict[str, np.ndarray], path: str | Path) -> Path:
    """The :func:`tile_owner_map` panels as images, one colour per tile (colours repeat every 20)."""
    fig, axes = new_figure(ncols=len(maps), size=(5.2 * len(maps) + 0.8, 4.8))
    axes = axes[0]
    for ax, (title, image) in zip(axes, maps.items()):
        tiles = np.unique(image[np.isfinite(image)])
        shown = ax.imshow(image % 20, cmap="tab20", vmin=0, vmax=20, interpolation="nearest")
        ax.set_title(f"{title}: {len(tiles)} tiles", fontsize=10)
        ax.set_xlabel("AO pair")
        ax.set_ylabel("AO pair")
    fig.colorbar(shown, ax=list(axes), label="tile number mod 20")
    return save_png(fig, path)
