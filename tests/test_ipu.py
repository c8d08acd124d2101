"""The simulated IPU: model, planner arithmetic, memory errors, executor agreement, profile."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pyscf import scf

from pyscf_ipu.cli import main
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.packed import batch_eris
from pyscf_ipu.prepare import prepare
from pyscf_ipu.ipu import IPUJK, TileMemoryError, Workload, ipu_model, plan, plan_on
from pyscf_ipu.ipu.contract import contract, layout, place
from pyscf_ipu.ipu.plan import split_even
from pyscf_ipu.ipu.profile import plot_tile_map, profile_report
from pyscf_ipu.molecule import from_name
from pyscf_ipu.rks import run_rks
from pyscf_ipu.units import HARTREE_TO_MEV
from .tolerances import LABEL_MEV


def member(stacked: dict) -> dict:
    """The J-K arrays of the first (only) conformer of a prepared batch."""
    return jax.tree.map(lambda a: a[0], stacked)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_presets_and_overrides():
    bow, mk2 = ipu_model("bow"), ipu_model("mk2", num_ipus=4, tiles=7)
    assert (bow.tiles, bow.threads_per_tile, bow.clock_hz, bow.exchange_bytes_per_s) == (1472, 6, 1.85e9, 11e12)
    assert (mk2.tiles, mk2.num_ipus, mk2.clock_hz, mk2.exchange_bytes_per_s) == (7, 4, 1.33e9, 8e12)
    assert bow.budget_bytes == int(624 * 1024 * 0.6)
    assert bow.tiles * bow.tile_memory_bytes == pytest.approx(900 * 2**20, rel=0.01)  # "900 MB": 897 MiB
    with pytest.raises(ValueError, match="unknown IPU model"):
        ipu_model("colossus")
    with pytest.raises(ValueError, match="available memory proportion"):
        ipu_model(available_memory_proportion=1.5)


@pytest.mark.parametrize("total, parts", [(10, 3), (1596, 1472), (5, 1472), (1, 1), (2**40 + 3, 1472)])
def test_split_even(total, parts):
    counts = split_even(total, parts)
    assert counts.sum() == total and len(counts) <= parts
    assert counts.max() == -(-total // parts)
    assert np.all(counts[:-1] == counts.max())  # only the last chunk is ragged


@pytest.mark.parametrize("strategy", ["rows", "s8"])
def test_plan_bytes_imbalance_and_time_follow_the_formulas(strategy):
    w = Workload(nao=56, unique_integrals=900_000)
    model = ipu_model("bow")
    p = plan_on(w, model, strategy, 1)
    npair, n2, b = 56 * 57 // 2, 56 * 56, 4
    used = int(np.count_nonzero(p.items))
    if strategy == "rows":
        assert p.items.sum() == 2 * npair
        expected = 2 * npair * (npair * b + b) + used * npair * b
        cycles_per_item = npair * model.rows_cycles_per_element
        out_bytes, in_bytes = 2 * npair * b, used * npair * b
    else:
        assert p.items.sum() == 900_000
        expected = 900_000 * (b + 8) + used * 3 * n2 * b
        cycles_per_item = model.s8_cycles_per_integral
        out_bytes, in_bytes = used * 2 * n2 * b, used * n2 * b
    assert p.total_bytes == expected == int(p.tile_bytes.sum())
    items = p.items[p.items > 0]
    assert p.imbalance == pytest.approx(items.max() / items.mean())
    jk = (items.max() * cycles_per_item + 2 * model.sync_cycles) / model.clock_hz + out_bytes / model.exchange_bytes_per_s
    assert p.jk_seconds == pytest.approx(jk)
    assert p.iteration_seconds == pytest.approx(
        jk + in_bytes / model.exchange_bytes_per_s + model.sync_cycles / model.clock_hz
    )


def test_no_index_overflow_up_to_400_aos():
    """Counts beyond int32 (N=400 has 3.2e9 unique integrals) stay exact, and the error says why."""
    w = Workload(nao=400, unique_integrals=Workload(400, 0).unique_total)
    assert w.unique_integrals > 2**31
    for strategy in ("rows", "s8"):
        p = plan_on(w, ipu_model(num_ipus=4), strategy, 4)
        assert p.items.sum() == (2 * w.npair if strategy == "rows" else w.unique_integrals)
        assert p.tile_bytes.min() >= 0 and p.total_bytes > 2**31
    with pytest.raises(TileMemoryError) as err:
        plan(w, ipu_model(num_ipus=64))
    message = str(err.value)
    assert "400 AOs" in message and "a tile may use only" in message and "--ipus" in message
    assert "--eri-threshold" in message


def test_spreads_over_ipus_when_one_is_not_enough():
    w = Workload(nao=150, unique_integrals=Workload(150, 0).unique_total)  # rows: 1.03 GB
    one = plan_on(w, ipu_model(), "rows", 1)
    assert not one.fits
    p = plan(w, ipu_model(num_ipus=8), "rows")
    assert p.fits and 1 < p.num_ipus <= 8 and not plan_on(w, ipu_model(), "rows", p.num_ipus - 1).fits
    assert p.link_bytes > 0


def test_auto_takes_the_fastest_fitting_strategy():
    w = Workload(nao=56, unique_integrals=1_000_000)
    model = ipu_model()
    chosen = plan(w, model, "auto")
    times = {s: plan(w, model, s).iteration_seconds for s in ("rows", "s8")}
    assert chosen.strategy.name == min(times, key=times.get)
    # 64 tiles with a 287 KB budget: rows needs 326 KB per tile, s8 225 KB; auto takes what fits
    tight = ipu_model(tiles=64, available_memory_proportion=0.45)
    assert not plan_on(w, tight, "rows", 1).fits
    assert plan(w, tight, "auto").strategy.name == "s8"


def relative_error(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module", params=[("benzene", "sto-3g"), ("water", "6-31g*"), ("h2", "sto-3g")])
def eri_case(request):
    name, basis = request.param
    host = prepare([from_name(name)], resolve(RKSConfig(basis=basis, xc="hf")))[0]
    c = np.random.default_rng(2).normal(size=(host.nao, max(1, host.nao // 2)))
    dm = c @ c.T / host.nao
    dense = resolve(RKSConfig(jk="dense")).backend
    data = member(dense.prepare(batch_eris([host.eri_s8], host.nao, np.float32), host.nao, np.float32))
    j, k = jax.jit(dense.contract)(data, jnp.asarray(dm, jnp.float32))
    return host, dm, np.asarray(j, np.float64), np.asarray(k, np.float64)


@pytest.mark.parametrize("strategy", ["rows", "s8"])
@pytest.mark.parametrize("tiles", [1, 7, 1472, 100_000])
def test_ipu_matches_dense_within_1e5(eri_case, strategy, tiles):
    """Acceptance: float32 J and K within 1e-5 relative of the dense reference, any tile count."""
    host, dm, j_ref, k_ref = eri_case
    # a teaching chip: 1 GiB tiles, so that even one tile may hold a whole molecule's integrals
    backend = IPUJK(ipu_model(tiles=tiles).replace(tile_memory_bytes=2**30), strategy)
    npad = host.nao + 2  # padded AOs stay empty
    data = member(backend.prepare(batch_eris([host.eri_s8], npad, np.float32), npad, np.float32))
    dm_pad = np.zeros((npad, npad), np.float32)
    dm_pad[: host.nao, : host.nao] = dm
    j, k = jax.jit(backend.contract)(data, jnp.asarray(dm_pad))
    n = host.nao
    assert relative_error(j[:n, :n], j_ref) < 1e-5 and relative_error(k[:n, :n], k_ref) < 1e-5
    assert np.all(np.asarray(j)[n:] == 0) and np.all(np.asarray(k)[n:] == 0)
    shape, p = backend.plans(host.eri, npad, np.float32)
    assert p.tiles_used <= tiles and p.items.sum() == p.strategy.total_items(p.workload)
    # the profiled (real) plan counts the molecule's own work, not the bucket's padding
    assert p.workload.nao == host.nao and p.workload.unique_integrals == np.count_nonzero(host.eri_s8)
    assert shape.workload.nao == npad and shape.items.sum() >= p.items.sum()


def test_four_ipus_on_four_devices():
    """1 and 4 simulated IPUs on 4 host devices (shard_map + psum / all_gather) agree with dense."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from pyscf_ipu.config import IPUConfig, RKSConfig
        from pyscf_ipu.resolution import resolve
        from pyscf_ipu.packed import batch_eris
        from pyscf_ipu.prepare import prepare
        from pyscf_ipu.ipu import ipu_model, plan_on, Workload
        from pyscf_ipu.ipu.contract import contract, layout, place
        from pyscf_ipu.molecule import from_name
        from pyscf_ipu.rks import run_rks
        assert jax.device_count() == 4
        for name, basis in [("benzene", "sto-3g"), ("water", "6-31g*")]:
            host = prepare([from_name(name)], resolve(RKSConfig(basis=basis, xc="hf")))[0]
            n = host.nao
            c = np.random.default_rng(3).normal(size=(n, n // 2)); dm = jnp.asarray(c @ c.T / n, jnp.float32)
            dense = resolve(RKSConfig(jk="dense")).backend
            j0, k0 = (np.asarray(a, np.float64) for a in dense.contract(jax.tree.map(lambda a: a[0], dense.prepare(batch_eris([host.eri_s8], n, np.float32), n, np.float32)), dm))
            w = Workload(n, int(np.count_nonzero(host.eri_s8)))
            for strategy in ("rows", "s8"):
                for ipus in (1, 4):
                    p = plan_on(w, ipu_model(num_ipus=4, tiles=7), strategy, ipus)
                    data = place(layout(p, p, host.eri, np.float32), ipus)
                    if ipus == 4:
                        leaf = data["rows"] if strategy == "rows" else data["values"]
                        assert len(leaf.sharding.device_set) == 4
                    j, k = jax.jit(contract)(data, dm)
                    for a, b in ((j, j0), (k, k0)):
                        err = float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))
                        assert err < 1e-5, (name, strategy, ipus, err)
        # a whole SCF whose plan must spread over IPUs: water/6-31g* (18 AOs, its own size bucket)
        # has 342 rows of 688 bytes; a 1-tile IPU with an 11% budget holds 70 KB, so 3 IPUs
        # (114 rows, 79 KB each) do not fit and 4 (86 rows, 60 KB) do
        config = RKSConfig(basis="6-31g*", ipu=IPUConfig(tiles=1, ipus=4, jk_strategy="rows", ipu_memory_proportion=0.11))
        r = run_rks(from_name("water"), config, profile=True)
        assert r.jk_profile["ipus_used"] == 4, r.jk_profile["ipus_used"]
        print("OK", r.energy, r.jk_profile["ipus_used"])
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout


def test_scf_with_ipu_backend_matches_pyscf(qm9_nine_heavy, reference):
    """The ipu backend in the jitted loop (the default) meets the float32 tolerance."""
    molecule = qm9_nine_heavy[21989]
    config = RKSConfig()
    assert config.jk == "ipu"
    result = run_rks(molecule, config, profile=True)
    ref = reference(molecule, config)
    for ours, theirs in ((result.energy, ref.energy), (result.homo, ref.homo), (result.lumo, ref.lumo)):
        assert abs(ours - theirs) * HARTREE_TO_MEV < LABEL_MEV
    assert result.jk_profile["strategy"] == "rows" and result.converged
    assert run_rks(from_name("water"), config).jk_profile is None  # the profile only where asked for


def test_memory_error_exits_2_from_the_cli(capsys):
    code = main(["run", "--mol", "benzene", "--tiles", "2", "--ipu-memory-proportion", "0.05"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not fit" in err and "a tile may use only" in err and "--ipus" in err and "Traceback" not in err


def test_profile_report_and_tile_map(tmp_path, drawn):
    report_path, png = tmp_path / "report.json", tmp_path / "tiles.png"
    code = main(["run", "--mol", "water", "--profile", str(report_path), "--profile-plot", str(png)])
    assert code == 0
    report = json.loads(report_path.read_text())
    tile_bytes = np.asarray(report["tile_bytes"])
    assert tile_bytes.sum() == report["total_bytes"]
    used = tile_bytes[tile_bytes > 0]
    assert report["tiles_used"] == used.size
    assert report["bytes_per_tile"]["max"] == used.max() and report["bytes_per_tile"]["min"] == used.min()
    assert report["eri_unique_kept"] <= report["eri_unique_total"]
    assert report["estimate"]["seconds_per_iteration"] > report["estimate"]["seconds_per_jk"] > 0
    assert "cycles" in report["estimate"]["formula"] and "s8_cycles_per_integral" in report["assumptions"]
    assert png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one panel per IPU, each titled with its tiles in use and showing their bytes (idle tiles masked)
    panels = [ax for ax in drawn[-1].axes if ax.get_images()]
    assert len(panels) == tile_bytes.shape[0]
    for ipu, ax in enumerate(panels):
        assert ax.get_title() == f"IPU {ipu}: {np.count_nonzero(tile_bytes[ipu])} tiles used"
        shown = ax.get_images()[0].get_array()
        assert shown.count() == np.count_nonzero(tile_bytes[ipu])
        assert shown.sum() == pytest.approx(tile_bytes[ipu].sum() / 1024)
    # the plot needs only the report: a saved report can be drawn again
    plot_tile_map(report, tmp_path / "again.png")
    assert (tmp_path / "again.png").stat().st_size > 5000


def test_profile_report_matches_plan():
    host = prepare([from_name("water")], resolve(RKSConfig(xc="hf")))[0]
    p = IPUJK(ipu_model(tiles=7), "s8").plans(host.eri, host.nao, np.float32)[1]
    report = profile_report(p, iterations=12)
    assert report["tiles_used"] == 7 and report["load_imbalance"] == pytest.approx(p.imbalance)
    assert report["estimate"]["seconds_all_iterations"] == pytest.approx(12 * p.iteration_seconds)
    assert report["eri_unique_kept"] == np.count_nonzero(host.eri_s8)
    # screening shows up as sparsity
    screened = prepare([from_name("water")], resolve(RKSConfig(eri_threshold=1e-2, xc="hf")))[0]
    p2 = IPUJK(ipu_model(tiles=7), "s8").plans(screened.eri, screened.nao, np.float32)[1]
    assert profile_report(p2, 1)["eri_sparsity"] > report["eri_sparsity"]


def test_layout_pads_only_the_last_tile():
    host = prepare([from_name("water")], resolve(RKSConfig(xc="hf")))[0]
    w = Workload(host.nao, int(np.count_nonzero(host.eri_s8)))
    p = plan_on(w, ipu_model(tiles=7), "s8", 1)
    data = layout(p, p, host.eri, np.float32)
    real = np.count_nonzero(data["values"], axis=-1)[0]  # non-zero values per tile
    np.testing.assert_array_equal(real, p.items[0, : len(real)])
    assert np.all(p.items[0, :-1][p.items[0, :-1] > 0] == p.max_items)
    # the same arrays, placed and contracted outside any SCF, give K symmetric
    j, k = contract(place(data, 1), jnp.eye(host.nao, dtype=jnp.float32))
    np.testing.assert_allclose(k, k.T, atol=1e-6)
    ref_j, ref_k = scf.hf.dot_eri_dm(host.eri_s8, np.eye(host.nao), hermi=1)
    assert relative_error(j, ref_j) < 1e-5 and relative_error(k, ref_k) < 1e-5


@pytest.mark.parametrize("ipus", [1, 3, 4])
def test_rows_placement_puts_every_row_where_row_source_says(ipus):
    """The rows layout built by slices (row_placement) equals the row matrix gathered by row_source,
    on ragged splits over tiles and IPUs, for one conformer and for a batch of two; built on the host
    (a CPU's way: host_tiled_rows, from float64 or float32 s8 arrays), bit for bit the same."""
    from pyscf_ipu.packed import row_matrix, s8_to_s4
    from pyscf_ipu.ipu.contract import device_tiled_rows, host_tiled_rows, row_placement, row_source, tile_shape

    host = prepare([from_name("water")], resolve(RKSConfig(xc="hf")))[0]
    n, npad = host.nao, host.nao + 3
    p = plan_on(Workload(npad, int(np.count_nonzero(host.eri_s8))), ipu_model(num_ipus=4, tiles=4), "rows", ipus)
    source = row_source(p)
    s8 = np.stack([host.eri_s8, 2.0 * host.eri_s8]).astype(np.float32)
    for eri in (s8[:1], s8):  # a batch of one, and of two
        placed = np.asarray(device_tiled_rows(jnp.asarray(eri), row_placement(p), n, npad, "float32"))
        assert placed.shape == eri.shape[:-1] + tile_shape(p) + (npad * (npad + 1) // 2,)
        for computed in (eri, eri.astype(np.float64)):
            np.testing.assert_array_equal(host_tiled_rows(computed, row_placement(p), n, npad, np.float32), placed)
        for k, one in enumerate(eri.reshape(-1, eri.shape[-1])):
            matrix = np.asarray(row_matrix(s8_to_s4(jnp.asarray(one), n * (n + 1) // 2), n, npad))
            expected = np.where((source >= 0)[:, None], matrix[np.maximum(source, 0)], 0.0)
            np.testing.assert_array_equal(placed.reshape(-1, *placed.shape[-4:])[k].reshape(expected.shape), expected)


def test_eri_tile_plan_covers_every_quartet_once_balanced_and_within_memory():
    """The device ERIs' tile plan: every canonical shell quartet but the one-centre ones exactly once
    (counted here from PySCF's shells directly), balanced within 25% on a 9-heavy-atom molecule, every
    tile within its budget; a smaller budget spreads it over more IPUs, an impossible one is refused."""
    from pyscf_ipu.pyscf_mole import build_mole
    from pyscf_ipu.integrals.eri_plan import plan_eri
    from pyscf_ipu.ipu.eri_tiles import plan_eri_tiles
    from pyscf_ipu.ipu.model import ipu_model
    from pyscf_ipu.ipu.plan import TileMemoryError
    from pyscf_ipu.qm9 import qm9_molecules

    mol = build_mole(qm9_molecules([21989])[0].molecule, "sto-3g")
    # the ERI kernels' shells: PySCF's shells of one atom with the same exponents (sp shells) are one
    groups = list(dict.fromkeys((mol.bas_atom(s), tuple(mol.bas_exp(s))) for s in range(mol.nbas)))
    atoms = np.array([atom for atom, _ in groups])
    pairs = [(a, b) for a in range(len(groups)) for b in range(a + 1)]
    same = np.array([atoms[a] == atoms[b] for a, b in pairs])
    pair_atom = np.array([atoms[a] for a, _ in pairs])
    one_centre = sum(int(np.sum(same[:i + 1] & (pair_atom[:i + 1] == pair_atom[i]))) for i in range(len(pairs)) if same[i])
    expected = len(pairs) * (len(pairs) + 1) // 2 - one_centre
    tiles = plan_eri_tiles(plan_eri(mol), ipu_model("bow", num_ipus=4))
    assert tiles.quartets == expected
    assert tiles.cuts[0] == 0 and tiles.cuts[-1] == expected and np.all(np.diff(tiles.cuts) > 0)
    assert tiles.num_ipus == 1 and tiles.tiles_used == 1472 and tiles.imbalance < 1.25
    assert tiles.tile_bytes.max() <= tiles.model.budget_bytes
    small = ipu_model("bow", num_ipus=4, available_memory_proportion=0.05)
    spread = plan_eri_tiles(plan_eri(mol), small)
    assert spread.num_ipus > 1 and spread.tile_bytes.max() <= small.budget_bytes
    with pytest.raises(TileMemoryError, match="fullest tile"):
        plan_eri_tiles(plan_eri(mol), ipu_model("bow", num_ipus=1, available_memory_proportion=0.01))
