"""Every plotting function writes a PNG (the notebooks show these files) that shows what it should:
each test reads the figure that was saved (its axes, titles, images and plotted data), not the
file's size alone."""

import numpy as np
import pytest

from pyscf_ipu.config import IPUConfig, RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.prepare import prepare
from pyscf_ipu.jk import jk_matrices
from pyscf_ipu.molecule import from_name
from pyscf_ipu.rks import run_rks
from pyscf_ipu.units import HARTREE_TO_EV

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000  # a real picture, not an empty canvas


def offsets(ax) -> np.ndarray:
    """(n, 2) the points of the first scatter plot on ``ax``."""
    from matplotlib.collections import PathCollection

    return next(c for c in ax.collections if isinstance(c, PathCollection)).get_offsets()


@pytest.fixture(scope="module")
def water():
    host = prepare([from_name("water")], resolve(RKSConfig()))[0]
    return host, run_rks(host.molecule, RKSConfig(), prepared=host)


def test_dft_plots(water, tmp_path, drawn):
    """The grid's points, the SCF's history, the frontier orbitals, the ERI matrix and two backends'
    J and K, each as the data says."""
    from pyscf_ipu.plotting import plot_eri, plot_grid, plot_jk, plot_orbitals, plot_scf_history

    host, result = water
    assert_png(plot_grid(host, tmp_path / "grid.png"))
    ax = drawn[-1].axes[0]
    points = int(np.count_nonzero(host.grid_weights > 0))
    assert len(offsets(ax)) == points and ax.get_title().startswith(f"{points:,} grid points")

    assert_png(plot_scf_history(result, tmp_path / "scf.png"))
    commutators = drawn[-1].axes[1].get_lines()[0].get_ydata()
    np.testing.assert_allclose(commutators, result.commutator_history)
    assert f"in {result.iterations} iterations" in drawn[-1].axes[1].get_title()

    assert_png(plot_orbitals(host, result, tmp_path / "orbitals.png", height=0.0, points=40))
    titles = [ax.get_title() for ax in drawn[-1].axes if ax.get_title()]
    homo = result.mo_energy[host.nocc - 1] * HARTREE_TO_EV
    assert any(title.startswith("HOMO") and f"{homo:.3f} eV" in title for title in titles), titles

    assert_png(plot_eri(host.eri_s8, host.nao, tmp_path / "eri.png"))
    left = drawn[-1].axes[0]
    assert left.get_images()[0].get_array().shape == (host.nao**2, host.nao**2)

    matrices = {name: jk_matrices(resolve(RKSConfig(jk=name)).backend, host.eri_s8, host.nao, result.density)
                for name in ("dense", "s8")}
    for dense, s8 in zip(matrices["dense"], matrices["s8"]):  # J, K: the two backends agree
        np.testing.assert_allclose(s8, dense, rtol=0, atol=1e-5 * np.abs(dense).max())
    assert_png(plot_jk(matrices, tmp_path / "jk.png"))
    shown = [ax for ax in drawn[-1].axes if ax.get_images()]
    assert len(shown) == 4  # J and K, each with s8's difference from dense
    np.testing.assert_allclose(shown[0].get_images()[0].get_array(), matrices["dense"][0])


def test_principal_frame_finds_the_plane_of_a_planar_molecule():
    from pyscf_ipu.plotting import principal_frame

    benzene = from_name("benzene").positions
    centre, axes = principal_frame(benzene)
    np.testing.assert_allclose(axes @ axes.T, np.eye(3), atol=1e-12)
    np.testing.assert_allclose((benzene - centre) @ axes[2], 0.0, atol=1e-6)  # all atoms in the plane


@pytest.mark.parametrize("strategy", ["rows", "s8"])
def test_tile_owner_map_places_everything_once(water, strategy, tmp_path, drawn):
    from pyscf_ipu.ipu.profile import plot_tile_owners, tile_owner_map

    host, _ = water
    n = host.nao
    shape, real = resolve(RKSConfig(ipu=IPUConfig(jk_strategy=strategy))).backend.plans(host.eri, n, np.float32)
    maps = tile_owner_map(shape, real, host.eri_s8, n)
    npair = n * (n + 1) // 2
    tiles = set()
    for image in maps.values():
        assert image.shape == (npair, npair)
        tiles |= set(np.unique(image[np.isfinite(image)]).astype(int))
    if strategy == "s8":  # every non-zero unique integral has exactly one owner
        (image,) = maps.values()
        assert np.count_nonzero(np.isfinite(image)) == np.count_nonzero(host.eri_s8)
    else:  # every row of J and of K has an owner
        assert all(np.isfinite(image).all() for image in maps.values())
    assert tiles == set(np.flatnonzero(real.items.reshape(-1) > 0))  # the tiles the plan uses, no others
    assert_png(plot_tile_owners(maps, tmp_path / "owners.png"))
    shown = [ax for ax in drawn[-1].axes if ax.get_images()]
    assert len(shown) == len(maps)  # one owner map per matrix the plan places
    assert sum(int(ax.get_title().split(": ")[-1].split()[0]) for ax in shown) >= len(tiles)  # "...: T tiles"


def test_dataset_plots(tmp_path, drawn):
    """``qm1b plot``'s histograms count every record and its bars the converged ones; the gap per
    conformer shows each conformer's gap."""
    from qm1b.generate import generate
    from qm1b.plots import plot_dataset, plot_gap_by_conformer
    from qm1b.settings import GenerateConfig
    from qm1b.store import open_dataset

    out = tmp_path / "data"
    generate(GenerateConfig(out=str(out), limit=1, conformers=2, progress=False), RKSConfig())
    columns = open_dataset(out).arrays().columns
    assert_png(plot_dataset(out, tmp_path / "dataset.png"))
    gaps, energies, bars = drawn[-1].axes
    assert sum(patch.get_height() for patch in gaps.patches) == len(columns["y"]) == 2
    assert sum(patch.get_height() for patch in energies.patches) == 2
    assert [patch.get_height() for patch in bars.patches] == [int(columns["converged"].sum()),
                                                              2 - int(columns["converged"].sum()), 0]  # fmt: skip
    assert_png(plot_gap_by_conformer(out, tmp_path / "gap.png"))
    np.testing.assert_allclose(np.sort(drawn[-1].axes[0].get_lines()[0].get_ydata()), np.sort(columns["y"]))
    with pytest.raises(ValueError, match="molecule 99 has no records"):
        plot_gap_by_conformer(out, tmp_path / "none.png", molecule_id=99)


def test_schnet_plots(tmp_path, drawn):
    from schnet.plots import plot_learning_curve, plot_predictions

    rows = [{"step": "10", "train_loss_mev": "900", "val_mae_mev": ""},  # as read_metrics returns them
            {"step": "20", "train_loss_mev": "500", "val_mae_mev": "700"},
            {"step": "30", "train_loss_mev": "300", "val_mae_mev": "450"}]  # fmt: skip
    assert_png(plot_learning_curve(rows, tmp_path / "curve.png"))
    train, validation = drawn[-1].axes[0].get_lines()[:2]
    assert list(train.get_xdata()) == [10, 20, 30] and list(train.get_ydata()) == [900, 500, 300]
    assert list(validation.get_xdata()) == [20, 30] and list(validation.get_ydata()) == [700, 450]  # the empty one left out
    rng = np.random.default_rng(0)
    true = rng.uniform(4, 8, 50)
    predicted = true + rng.normal(0, 0.2, 50)
    assert_png(plot_predictions(true, predicted, tmp_path / "scatter.png"))
    ax = drawn[-1].axes[0]
    np.testing.assert_allclose(offsets(ax), np.stack([true, predicted], axis=1))
    assert f"MAE {1000 * np.abs(predicted - true).mean():.0f} meV" in ax.get_title()


def test_scaling_plot(tmp_path, drawn):
    from schnet.plots import plot_scaling

    results = [(1000, 290.0), (4000, 160.0), (16000, 95.0)]
    assert_png(plot_scaling(results, tmp_path / "scaling.png", label="small"))
    line = drawn[-1].axes[0].get_lines()[0]
    assert list(zip(line.get_xdata(), line.get_ydata())) == results and line.get_label() == "small"
