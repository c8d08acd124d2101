"""Pictures of one calculation: the grid, the SCF convergence, orbitals, the ERI and J-K matrices.

Each function draws a matplotlib figure from library objects, writes it as a PNG to ``path`` and
returns the path (see :mod:`pyscf_ipu.figures`); the notebooks show the PNGs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .figures import new_figure, save_png
from .prepare import PreparedProblem
from .results import SCFResult
from .units import HARTREE_TO_EV


def principal_frame(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(centre (3,), axes (3, 3)): the atoms' centroid and principal axes, largest spread first.

    The first two axes span the best-fit plane of the molecule (its own plane if it is planar);
    the third is that plane's normal.
    """
    centre = positions.mean(axis=0)
    _, _, axes = np.linalg.svd(positions - centre)
    if len(positions) < 3:  # fewer than three atoms: complete the frame
        axes = np.linalg.qr(np.vstack([axes, np.eye(3)]).T)[0].T[:3]
    return centre, axes


def _atoms_in_plane(ax, prepared: PreparedProblem, centre, axes) -> None:
    xy = (prepared.molecule.positions - centre) @ axes[:2].T
    ax.scatter(xy[:, 0], xy[:, 1], s=40, c="black", zorder=3)
    for (x, y), symbol in zip(xy, prepared.molecule.symbols):
        ax.annotate(symbol, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=8, zorder=4)


def plot_grid(prepared: PreparedProblem, path: str | Path) -> Path:
    """The integration grid projected onto the molecule's plane, each point coloured by log10 weight."""
    centre, axes = principal_frame(prepared.molecule.positions)
    real = prepared.grid_weights > 0  # zero weight: PySCF's alignment padding, points Becke gives nothing
    xy = (prepared.grid_coords[real] - centre) @ axes[:2].T
    log_w = np.log10(prepared.grid_weights[real])
    order = np.argsort(log_w)  # heavy (outer) points last, on top
    fig, ((ax,),) = new_figure(size=(6.5, 5.5))
    low = np.percentile(log_w, 2)  # a few near-zero Becke weights would stretch the scale to 1e-40
    points = ax.scatter(xy[order, 0], xy[order, 1], c=np.maximum(log_w[order], low), s=3, cmap="viridis",
                        linewidths=0)  # fmt: skip
    _atoms_in_plane(ax, prepared, centre, axes)
    fig.colorbar(points, ax=ax, label="log10 quadrature weight (Bohr^3)")
    ax.set_aspect("equal")
    ax.set_xlabel("first principal axis (Bohr)")
    ax.set_ylabel("second principal axis (Bohr)")
    ax.set_title(f"{int(real.sum()):,} grid points, projected onto the molecular plane")
    return save_png(fig, path)


def plot_scf_history(result: SCFResult, path: str | Path) -> Path:
    """Energy error and change, and DIIS error (max|FDS - SDF|), against iteration, on log axes."""
    iterations = np.arange(1, result.iterations + 1)
    fig, ((left, right),) = new_figure(ncols=2, size=(10, 3.8))
    error = np.abs(result.energy_history - result.energy)
    left.semilogy(iterations, np.maximum(error, 1e-12), marker="o", label="|E_k - E_final|")
    # The loop's float32 totals resolve ~1e-4 Ha of a few hundred; its energy changes, summed from
    # the density step (trapezoid rule, see scf.py), keep falling below that.
    changes = np.abs(result.energy_change_history[1:])
    left.semilogy(iterations[1:], np.maximum(changes, 1e-12), marker=".", label="|E_k - E_k-1|")
    left.legend()
    left.set_ylabel("Hartree")
    left.set_title(f"energy, final {result.energy:.6f} Ha")
    right.semilogy(iterations, result.commutator_history, marker="o", color="tab:orange")
    right.set_ylabel("DIIS error max|FDS - SDF|")
    right.set_title(f"{'converged' if result.converged else 'NOT converged'} in {result.iterations} iterations")
    for ax in (left, right):
        ax.set_xlabel("iteration")
        ax.grid(True, which="both", alpha=0.3)
    return save_png(fig, path)


def plot_orbitals(prepared: PreparedProblem, result: SCFResult, path: str | Path, *, height: float = 1.0,
                  margin: float = 3.0, points: int = 120) -> Path:  # fmt: skip
    """Contour slices of the HOMO and LUMO in a plane parallel to the molecule's, ``height`` Bohr above it.

    The plane is the atoms' best-fit plane (:func:`principal_frame`) shifted along its normal: the
    frontier orbitals of planar conjugated molecules (benzene's) are pi orbitals, which vanish in
    the molecular plane itself. ``height=0`` slices through the atoms.
    """
    from pyscf import dft

    centre, axes = principal_frame(prepared.molecule.positions)
    xy = (prepared.molecule.positions - centre) @ axes[:2].T
    lo, hi = xy.min(axis=0) - margin, xy.max(axis=0) + margin
    s, t = np.meshgrid(np.linspace(lo[0], hi[0], points), np.linspace(lo[1], hi[1], points))
    plane = centre + s.reshape(-1, 1) * axes[0] + t.reshape(-1, 1) * axes[1] + height * axes[2]  # (P, 3)
    ao = dft.numint.eval_ao(prepared.mol, plane)  # (P, N)
    nocc = prepared.nocc
    fig, axes_grid = new_figure(ncols=2, size=(11, 4.8))
    for ax, (name, index) in zip(axes_grid[0], (("HOMO", nocc - 1), ("LUMO", nocc))):
        values = (ao @ result.mo_coeff[:, index]).reshape(s.shape)
        top = np.abs(values).max()
        levels = np.linspace(-top, top, 21)
        filled = ax.contourf(s, t, values, levels=levels, cmap="RdBu_r")
        ax.contour(s, t, values, levels=levels[1::2], colors="k", linewidths=0.3)
        _atoms_in_plane(ax, prepared, centre, axes)
        fig.colorbar(filled, ax=ax, label="orbital value (Bohr^-3/2)")
        ax.set_aspect("equal")
        ax.set_xlabel("Bohr")
        ax.set_title(f"{name}: {result.mo_energy[index] * HARTREE_TO_EV:.3f} eV, slice {height:g} Bohr above the plane")
    return save_png(fig, path)


def plot_eri(eri_s8: np.ndarray, nao: int, path: str | Path, *, threshold: float = 1e-10) -> Path:
    """The ERI as the (N^2, N^2) matrix [(ij), (kl)] in log10 magnitude, and its unique part after screening.

    Left: all N^4 elements. Right: the (npair, npair) matrix of AO pairs, whose lower triangle holds
    the N(N+1)/2 (N(N+1)/2 + 1)/2 unique integrals (8-fold symmetry: i<->j, k<->l, ij<->kl) coloured
    by their Schwarz bound sqrt((ij|ij)(kl|kl)); grey where that bound is below ``threshold``.
    """
    from pyscf import ao2mo

    eri_s8 = np.asarray(eri_s8, np.float64)  # JAX integrals come in float32; ao2mo reads doubles
    full = ao2mo.restore(1, eri_s8, nao).reshape(nao * nao, nao * nao)
    npair = nao * (nao + 1) // 2
    s4 = ao2mo.restore(4, eri_s8, nao)  # (npair, npair)
    diag = np.sqrt(np.abs(np.diag(s4)))
    bound = np.outer(diag, diag)
    lower = np.tril(np.ones((npair, npair), bool))
    screened = lower & (bound < threshold)
    kept = lower & ~screened
    fig, ((left, right),) = new_figure(ncols=2, size=(12, 5.4))
    image = left.imshow(np.log10(np.maximum(np.abs(full), 1e-12)), cmap="magma", vmin=-12, interpolation="nearest")
    fig.colorbar(image, ax=left, label="log10 |(ij|kl)| (Hartree)")
    left.set_title(f"(ij|kl) as an ({nao * nao}, {nao * nao}) matrix: {nao**4:,} elements")
    left.set_xlabel("kl = k * N + l")
    left.set_ylabel("ij = i * N + j")
    from matplotlib.colors import ListedColormap

    shown = np.where(kept, np.log10(np.maximum(bound, 1e-16)), np.nan)
    image = right.imshow(shown, cmap="viridis", interpolation="nearest")
    right.imshow(np.where(screened, 1.0, np.nan), cmap=ListedColormap(["0.6"]), interpolation="nearest")
    fig.colorbar(image, ax=right, label="log10 Schwarz bound")
    unique = npair * (npair + 1) // 2
    right.set_title(f"unique: {unique:,} ({unique / nao**4:.1%}); {int(kept.sum()):,} kept at {threshold:g}, "
                    f"{int(screened.sum()):,} screened (grey)", fontsize=9)  # fmt: skip
    right.set_xlabel("pair kl (k >= l)")
    right.set_ylabel("pair ij (i >= j)")
    return save_png(fig, path)


def plot_jk(matrices: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path) -> Path:
    """J and K of the first entry of ``matrices`` (name -> (J, K)), and every other entry's difference from it."""
    names = list(matrices)
    reference = names[0]
    fig, axes = new_figure(ncols=len(names), nrows=2, size=(4.2 * len(names), 7.4))
    for row, label in enumerate("JK"):
        ref = np.asarray(matrices[reference][row], np.float64)
        image = axes[row, 0].imshow(ref, cmap="RdBu_r", vmin=-np.abs(ref).max(), vmax=np.abs(ref).max())
        fig.colorbar(image, ax=axes[row, 0], shrink=0.8)
        axes[row, 0].set_title(f"{label} ({reference})")
        for col, name in enumerate(names[1:], start=1):
            diff = np.abs(np.asarray(matrices[name][row], np.float64) - ref)
            image = axes[row, col].imshow(np.log10(np.maximum(diff, 1e-12)), cmap="magma", vmin=-12)
            fig.colorbar(image, ax=axes[row, col], shrink=0.8, label="log10 |difference|")
            axes[row, col].set_title(f"{label}: |{name} - {reference}|, max {diff.max():.1e}")
    return save_png(fig, path)


__all__ = ["plot_eri", "plot_grid", "plot_jk", "plot_orbitals", "plot_scf_history", "principal_frame"]
