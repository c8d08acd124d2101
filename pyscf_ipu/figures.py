"""Shared plumbing of the PNG-writing plot functions (pyscf_ipu, qm1b and schnet).

Figures are built with matplotlib's object-oriented API (``matplotlib.figure.Figure``), so no plot
function touches pyplot's global state or the backend; the notebooks show the PNGs they write.
"""

from __future__ import annotations

from pathlib import Path


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (6.0, 4.0)):
    """(figure, (nrows, ncols) array of axes) with a constrained layout."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save_png(fig, path: str | Path, dpi: int = 100) -> Path:
    """Write ``fig`` to ``path`` (parent folders created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
