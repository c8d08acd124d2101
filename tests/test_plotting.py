"""Every plotting function writes a non-empty PNG (the notebooks show these files)."""

import numpy as np
import pytest

from pyscf_ipu.config import IPUConfig, RKSConfig
from pyscf_ipu.method import resolve
from pyscf_ipu.prepare import prepare
from pyscf_ipu.jk import jk_matrices
from pyscf_ipu.molecule import from_name
from pyscf_ipu.rks import run_rks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000  # a real picture, not an empty canvas


@pytest.fixture(scope="module")
def water():
    host = prepare([from_name("water")], resolve(RKSConfig()))[0]
    return host, run_rks(host.molecule, RKSConfig(), prepared=host)


def test_dft_plots(water, tmp_path):
    from pyscf_ipu.plotting import plot_eri, plot_grid, plot_jk, plot_orbitals, plot_scf_history

    host, result = water
    assert_png(plot_grid(host, tmp_path / "grid.png"))
    assert_png(plot_scf_history(result, tmp_path / "scf.png"))
    assert_png(plot_orbitals(host, result, tmp_path / "orbitals.png", height=0.0, points=40))
    assert_png(plot_eri(host.eri_s8, host.nao, tmp_path / "eri.png"))
    matrices = {name: jk_matrices(resolve(RKSConfig(jk=name)).backend, host.eri_s8, host.nao, result.density)
                for name in ("dense", "s8")}
    assert_png(plot_jk(matrices, tmp_path / "jk.png"))


def test_principal_frame_finds_the_plane_of_a_planar_molecule():
    from pyscf_ipu.plotting import principal_frame

    benzene = from_name("benzene").positions
    centre, axes = principal_frame(benzene)
    np.testing.assert_allclose(axes @ axes.T, np.eye(3), atol=1e-12)
    np.testing.assert_allclose((benzene - centre) @ axes[2], 0.0, atol=1e-6)  # all atoms in the plane


@pytest.mark.parametrize("strategy", ["rows", "s8"])
def test_tile_owner_map_places_everything_once(water, strategy, tmp_path):
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


def test_dataset_plots(tmp_path):
    from qm1b.generate import GenerateConfig, generate
    from qm1b.plots import plot_dataset, plot_gap_by_conformer

    out = tmp_path / "data"
    generate(GenerateConfig(out=str(out), limit=1, conformers=2, progress=False), RKSConfig())
    assert_png(plot_dataset(out, tmp_path / "dataset.png"))
    assert_png(plot_gap_by_conformer(out, tmp_path / "gap.png"))
    with pytest.raises(ValueError, match="molecule 99 has no records"):
        plot_gap_by_conformer(out, tmp_path / "none.png", molecule_id=99)


def test_schnet_plots(tmp_path):
    from schnet.plots import plot_learning_curve, plot_predictions

    rows = [{"step": "10", "train_loss_mev": "900", "val_mae_mev": ""},  # as read_metrics returns them
            {"step": "20", "train_loss_mev": "500", "val_mae_mev": "700"},
            {"step": "30", "train_loss_mev": "300", "val_mae_mev": "450"}]  # fmt: skip
    assert_png(plot_learning_curve(rows, tmp_path / "curve.png"))
    rng = np.random.default_rng(0)
    true = rng.uniform(4, 8, 50)
    assert_png(plot_predictions(true, true + rng.normal(0, 0.2, 50), tmp_path / "scatter.png"))


def test_scaling_plot(tmp_path):
    from schnet.plots import plot_scaling

    assert_png(plot_scaling([(1000, 290.0), (4000, 160.0), (16000, 95.0)], tmp_path / "scaling.png", label="small"))
