"""SchNet: parameter counts, invariances, padding, neighbour lists, no recompilation, learning, resume, CLI.

Tolerances: predictions are float32 sums over a few dozen atoms of O(1) terms, so equal inputs
reordered (atoms permuted, coordinates rotated) agree to about 1e-6 relative; we allow 1e-5.
"""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from schnet.cli import eval_main, train_main
from schnet.config import CONFIGS
from schnet.data import GraphSet, Layout, batches, pair_count, layout_for, load_qm9, pack, pad_batch, split_by_group
from schnet.model import SchNet, neighbour_pairs, parameter_count
from schnet.train import (Normaliser, TrainConfig, l1_loss, load_run, make_train_step, normalised_output, optimizer,
                          read_metrics, train)

RTOL = 1e-5


@pytest.fixture(scope="module")
def qm9() -> GraphSet:
    return load_qm9(400)


@pytest.fixture(scope="module")
def tiny() -> SchNet:
    return SchNet(CONFIGS["tiny"], key=jax.random.key(0))


def roomy(graphs: GraphSet, count: int) -> Layout:
    """A layout that holds the first ``count`` graphs whatever the neighbour rule."""
    return Layout(count, int(graphs.natoms[:count].sum()), int(np.sum(graphs.natoms[:count] ** 2)), graphs.max_atoms)


def predict(model, batch, layout):
    return np.asarray(normalised_output(model, batch, layout)[0])


def test_parameter_counts_match_torch_geometric():
    """torch_geometric's SchNet has 9,088,513 (QM1B's 9M config) and 238,465 (small) parameters (docs/benchmarking.md)."""
    counts = {name: parameter_count(SchNet(CONFIGS[name], key=jax.random.key(0))) for name in ("schnet-9m", "small")}
    print(f"schnet-9m: {counts['schnet-9m']:,} parameters; small: {counts['small']:,}")
    assert counts == {"schnet-9m": 9_088_513, "small": 238_465}


def test_rotation_translation_and_permutation_invariance(qm9, tiny):
    layout = roomy(qm9, 8)
    batch = pad_batch(qm9, range(8), layout)
    reference = predict(tiny, batch, layout)
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))  # a random orthogonal matrix (rotation or reflection)
    moved = eqx.tree_at(lambda b: b.pos, batch, jnp.asarray(np.asarray(batch.pos) @ q.T + rng.normal(size=3) * 5.0, jnp.float32))
    np.testing.assert_allclose(predict(tiny, moved, layout), reference, rtol=RTOL, atol=1e-6)
    # permute the atoms within every graph (graphs stay contiguous)
    off = qm9.offsets
    order = np.concatenate([off[g] + rng.permutation(qm9.natoms[g]) for g in range(8)])
    z, pos = np.asarray(batch.z).copy(), np.asarray(batch.pos).copy()
    m = len(order)
    z[:m], pos[:m] = qm9.z[order], qm9.pos[order]
    permuted = eqx.tree_at(lambda b: (b.z, b.pos), batch, (jnp.asarray(z), jnp.asarray(pos)))
    np.testing.assert_allclose(predict(tiny, permuted, layout), reference, rtol=RTOL, atol=1e-6)
    assert np.ptp(reference) > 0  # the graphs really differ


def test_padding_changes_no_prediction(qm9, tiny):
    tight = roomy(qm9, 5)
    loose = Layout(16, tight.atoms + 100, tight.pairs + 500, tight.graph_atoms + 3)  # 11 padded graphs, more of all
    a = predict(tiny, pad_batch(qm9, range(5), tight), tight)
    b = predict(tiny, pad_batch(qm9, range(5), loose), loose)
    np.testing.assert_allclose(b[:5], a, rtol=RTOL, atol=1e-6)
    assert np.all(b[5:] == 0)  # padded graphs get nothing


def test_knn_and_radius_graph_agree_when_k_covers_every_atom(qm9):
    radius = SchNet(CONFIGS["tiny"].replace(neighbours=None), key=jax.random.key(1))
    knn = SchNet(CONFIGS["tiny"].replace(neighbours=64), key=jax.random.key(1))  # same parameters
    layout = roomy(qm9, 6)
    batch = pad_batch(qm9, range(6), layout)
    np.testing.assert_allclose(predict(knn, batch, layout), predict(radius, batch, layout), rtol=RTOL, atol=1e-6)


def directed_edges(graphs: GraphSet, count: int, k: int | None, cutoff: float) -> set[tuple[int, int]]:
    """(i, j): i receives from j, for the first ``count`` graphs, by a direct float64 search in numpy."""
    expected, off = set(), graphs.offsets
    for g in range(count):
        pos = graphs.pos[off[g] : off[g + 1]].astype(np.float64)
        d = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
        np.fill_diagonal(d, np.inf)
        keep = d < cutoff
        if k is not None and k < len(pos) - 1:  # fewer atoms than k + 1: all of them are neighbours
            keep &= d <= np.sort(d, axis=1)[:, [k - 1]]
        expected |= {(off[g] + i, off[g] + j) for i, j in zip(*np.nonzero(keep))}
    return expected


@pytest.mark.parametrize("k", [2, 5, None])
def test_neighbour_pairs_match_a_direct_search(qm9, k):
    """The pairs and their direction flags give exactly the edges of a direct search (k nearest is not symmetric)."""
    layout = roomy(qm9, 4)
    batch = pad_batch(qm9, range(4), layout)
    pairs = neighbour_pairs(batch.pos, batch.atom_mask, batch.graph_index, k, 3.0, layout.pairs, layout.graph_atoms)
    real = np.arange(layout.pairs) < int(pairs.count)
    i, j = np.asarray(pairs.first)[real], np.asarray(pairs.second)[real]
    forward, backward = np.asarray(pairs.forward)[real] == 1, np.asarray(pairs.backward)[real] == 1
    found = {(a, b) for a, b in zip(i[forward], j[forward])} | {(b, a) for a, b in zip(i[backward], j[backward])}
    expected = directed_edges(qm9, 4, k, 3.0)
    assert found == expected
    assert np.all(i < j) and np.all(forward | backward) and len(set(zip(i, j))) == len(i)  # each pair once, used
    assert np.all(np.diff(i) >= 0)  # sorted, as segment_sum is told
    assert np.all(np.asarray(pairs.forward)[~real] == 0) and np.all(np.asarray(pairs.backward)[~real] == 0)
    if k == 2:
        assert np.count_nonzero(forward != backward) > 0  # the asymmetric case really is exercised


def test_model_matches_an_edge_by_edge_schnet(qm9):
    """The pair-wise model equals SchNet written edge by edge (numpy, float64) with k = 3, where many
    neighbourhoods are one-sided."""
    config = CONFIGS["tiny"].replace(neighbours=3)
    model = SchNet(config, key=jax.random.key(3))
    layout = roomy(qm9, 5)
    batch = pad_batch(qm9, range(5), layout)
    edges = np.array(sorted(directed_edges(qm9, 5, 3, config.cutoff)))  # (E, 2) target, source
    target, source = edges[:, 0], edges[:, 1]
    m = int(qm9.natoms[:5].sum())
    pos = qm9.pos[:m].astype(np.float64)
    d = np.linalg.norm(pos[target] - pos[source], axis=-1)  # (E,)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    lin = lambda layer, x: x @ f64(layer.weight).T + (0 if layer.bias is None else f64(layer.bias))  # noqa: E731
    ssp = lambda x: np.logaddexp(x, 0.0) - np.log(2.0)  # noqa: E731
    rbf = f64(model.radial_basis(jnp.asarray(d, jnp.float32)))  # (E, G) the same Gaussians
    envelope = 0.5 * (np.cos(np.pi * d / config.cutoff) + 1.0)
    x = f64(model.embedding.weight)[qm9.z[:m]]  # (m, F)
    for block in model.interactions:
        w = lin(block.filter_out, ssp(lin(block.filter_in, rbf))) * envelope[:, None]  # (E, W)
        messages = np.zeros((m, config.filters))
        np.add.at(messages, target, lin(block.atom_in, x)[source] * w)
        x = x + lin(block.update, ssp(lin(block.atom_out, messages)))
    atoms = lin(model.head_out, ssp(lin(model.head_hidden, x)))[:, 0]
    expected = np.bincount(np.repeat(np.arange(5), qm9.natoms[:5]), atoms)
    got = predict(model, batch, layout)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=1e-5)


def test_pair_budgets_bound_what_the_model_finds(qm9):
    config = CONFIGS["small"]
    counts = pair_count(qm9, config.neighbours, config.cutoff)
    layout = layout_for(qm9, counts, 32)
    order = np.random.default_rng(0).permutation(len(qm9))  # as training packs them (QM9's own order grows in size)
    chunks = pack(order, qm9, counts, layout)
    assert np.array_equal(np.concatenate(chunks), order)  # every graph once, in the given order
    for chunk in chunks:
        batch = pad_batch(qm9, chunk, layout)
        pairs = neighbour_pairs(batch.pos, batch.atom_mask, batch.graph_index, config.neighbours, config.cutoff,
                                layout.pairs, layout.graph_atoms)  # fmt: skip
        assert int(pairs.count) <= counts[chunk].sum() <= layout.pairs
    print(f"{len(chunks)} batches for {len(qm9)} graphs ({layout})")
    assert len(chunks) <= 1.1 * len(qm9) / 32  # nearly every batch is full


def test_train_step_compiles_once_and_overfits_one_batch(qm9, tiny):
    """tiny drives one batch of 8 molecules to near-zero training loss within a few hundred steps.

    Near zero: below 2% of the initial L1 (measured: 1571 -> 21 meV). Adam on an L1 loss takes
    steps of about the learning rate whatever the error, so the rate decays (x0.8 every 60 steps).
    """
    train_config = TrainConfig(config="tiny", learning_rate=1e-2, warmup_steps=1, decay_steps=60, decay_rate=0.8)
    layout = roomy(qm9, 16)
    batch = pad_batch(qm9, range(8), layout)
    norm = Normaliser(float(qm9.target[:8].mean()), float(qm9.target[:8].std()))
    tx = optimizer(train_config)
    params, static = eqx.partition(tiny, eqx.is_array)
    step = make_train_step(tx, static, norm, layout)
    opt_state = tx.init(params)
    first = float(l1_loss(tiny, batch, norm, layout)[0])
    for _ in range(600):
        params, opt_state, loss, _ = step(params, opt_state, batch)
    other = pad_batch(qm9, range(8, 16), layout)  # other graphs, other atom and edge counts, same layout
    step(params, opt_state, other)
    assert step._cache_size() == 1  # one compilation for every batch of this layout
    final = float(loss) * norm.std * 1000
    print(f"overfit: L1 {first * norm.std * 1000:.0f} -> {final:.1f} meV in 600 steps")
    assert final < 0.02 * first * norm.std * 1000


def test_split_by_molecule_is_disjoint_deterministic_and_sized():
    group = np.repeat(np.array([f"m{i}" for i in range(50)]), 4)  # 50 molecules x 4 conformers
    graphs = GraphSet(np.ones(200, np.int32), np.zeros((200, 3), np.float32), np.ones(200, int), np.zeros(200), group)
    a = split_by_group(graphs, val=40, test=0.1, seed=3)
    b = split_by_group(graphs, val=40, test=0.1, seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert len(a["val"]) == 40 and len(a["test"]) == 20 and len(a["train"]) == 140
    sides = [set(group[a[k]]) for k in ("train", "val", "test")]
    assert not (sides[0] & sides[1] or sides[0] & sides[2] or sides[1] & sides[2])
    c = split_by_group(graphs, val=40, train=20, seed=4)
    assert len(c["train"]) == 20 and not set(group[c["train"]]) & set(group[c["val"]])


def test_resume_equals_uninterrupted(qm9, tmp_path):
    common = dict(config="tiny", num_val=80, val_every=10, warmup_steps=5, batch_size=16, progress=False)
    train(TrainConfig(out=str(tmp_path / "whole"), steps=30, **common), qm9)
    train(TrainConfig(out=str(tmp_path / "split"), steps=20, **common), qm9)
    summary = train(TrainConfig(out=str(tmp_path / "split"), steps=30, resume=True, **common), qm9)
    whole, _ = load_run(tmp_path / "whole")
    resumed, state = load_run(tmp_path / "split")
    assert state.step == 30
    for a, b in zip(jax.tree.leaves(eqx.filter(whole, eqx.is_array)), jax.tree.leaves(eqx.filter(resumed, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    rows = (tmp_path / "split" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["10", "20", "30"]  # nothing repeated, nothing lost
    assert (tmp_path / "split" / "learning_curve.png").stat().st_size > 5000
    assert summary["val_mae_mev"] > 0
    again = train(TrainConfig(out=str(tmp_path / "split"), steps=30, resume=True, **common), qm9)  # already done
    assert again["val_mae_mev"] == pytest.approx(summary["val_mae_mev"], abs=1e-3)
    with pytest.raises(ValueError, match="other settings"):
        train(TrainConfig(out=str(tmp_path / "split"), steps=40, resume=True, **{**common, "batch_size": 8}), qm9)


def test_batches_are_deterministic_and_resumable(qm9):
    counts = pair_count(qm9, 12, 5.0)
    layout = layout_for(qm9, counts, 16)
    stream = batches(qm9, np.arange(100), counts, layout, seed=5)
    first = [next(stream) for _ in range(9)]  # crosses an epoch (about 7 batches per epoch)
    later = batches(qm9, np.arange(100), counts, layout, seed=5, start=7)
    np.testing.assert_array_equal(next(later).z, first[7].z)
    assert not np.array_equal(first[0].z, first[7].z)  # the next epoch is reshuffled


def test_cli_train_then_eval(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--config", "tiny", "--data", "qm9", "--limit", "300", "--steps", "20", "--num-val", "60",
            "--val-every", "10", "--warmup-steps", "5", "--out", str(out), "--no-progress"]  # fmt: skip
    assert train_main(args) == 0
    assert "final validation MAE" in capsys.readouterr().out
    assert eval_main(["--run", str(out), "--split", "val"]) == 0
    report = json.loads(capsys.readouterr().out)
    last = (out / "metrics.csv").read_text().splitlines()[-1].split(",")
    assert report["count"] == 60 and abs(report["mae_ev"] * 1000 - float(last[2])) < 0.01  # the same model, the same split
    assert train_main(args) == 2 and "--resume" in capsys.readouterr().err  # an existing run is not overwritten
    assert train_main(["--config", "huge"]) == 2
    assert eval_main(["--run", str(tmp_path / "nothing")]) == 2


def test_data_parallel_equals_one_device_on_the_same_global_batch(tmp_path):
    """4 simulated devices (shard_map, gradients summed) give 1 device's loss trajectory on the union batch.

    Tolerance 1e-5 relative: only the order of float32 sums differs.
    """
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(
        f"""
        import jax, numpy as np, equinox as eqx
        from schnet.config import CONFIGS
        from schnet.data import Layout, pair_count, layout_for, load_qm9, pack, pad_batch
        from schnet.model import SchNet
        from schnet.train import Normaliser, TrainConfig, device_batches, make_train_step, optimizer, train
        assert jax.device_count() == 4
        graphs = load_qm9(200)
        config = CONFIGS["tiny"]
        pairs = pair_count(graphs, config.neighbours, config.cutoff)
        per = layout_for(graphs, pairs, 4)
        chunks = pack(np.random.default_rng(1).permutation(len(graphs)), graphs, pairs, per)[:20]
        union = Layout(4 * per.graphs, 4 * per.atoms, 4 * per.pairs, per.graph_atoms)
        tx = optimizer(TrainConfig(config="tiny", learning_rate=1e-3, warmup_steps=1))
        params, static = eqx.partition(SchNet(config, key=jax.random.key(0)), eqx.is_array)
        norm = Normaliser(float(graphs.target.mean()), float(graphs.target.std()))
        parallel, single = make_train_step(tx, static, norm, per, 4), make_train_step(tx, static, norm, union, 1)
        p4, o4, p1, o1 = params, tx.init(params), params, tx.init(params)
        stream = device_batches((pad_batch(graphs, c, per) for c in chunks), 4)
        for s in range(5):
            p4, o4, l4, _ = parallel(p4, o4, next(stream))
            p1, o1, l1, _ = single(p1, o1, pad_batch(graphs, np.concatenate(chunks[4 * s : 4 * s + 4]), union))
            assert abs(float(l4) - float(l1)) <= 1e-5 * abs(float(l1)), (s, float(l4), float(l1))
        for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        summary = train(TrainConfig(config="tiny", out={str(tmp_path / "run")!r}, steps=4, batch_size=16,
                                    num_val=40, val_every=2, warmup_steps=1, progress=False), graphs)
        assert summary["val_mae_mev"] > 0
        print("OK", float(l4), float(l1))
        """
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK" in proc.stdout


def test_qm1b_shards_and_parquet_load_the_same_graphs(qm9, tmp_path):
    """A qm1b dataset (written by the generator's ShardWriter) and its Parquet export give the same graphs."""
    from pyscf_ipu.units import BOHR_PER_ANGSTROM
    from qm1b.schema import RecordBatch
    from qm1b.store import ShardWriter, export_parquet

    from schnet.data import load

    n, off = 6, qm9.offsets
    homo = -np.linspace(5, 7, n)
    columns = {
        "smile": [f"S{i // 2}" for i in range(n)], "atoms": ["".join("X" * int(a)) for a in qm9.natoms[:n]],
        "energy": -np.arange(n) * 100.0, "homo": homo, "lumo": homo + qm9.target[:n], "y": qm9.target[:n],
        "N": np.full(n, 10), "std": np.zeros(n), "converged": np.ones(n, bool), "iterations": np.full(n, 12),
        "seconds": np.ones(n), "molecule_id": np.arange(n) // 2, "conformer_id": np.arange(n) % 2,
    }  # fmt: skip
    records = RecordBatch.from_columns(columns, qm9.natoms[:n], qm9.z[: off[n]], qm9.pos[: off[n]] * BOHR_PER_ANGSTROM)
    with ShardWriter(tmp_path / "data", settings={"basis": "sto-3g"}, versions={}) as writer:
        writer.commit(records)
    from_shards = load(str(tmp_path / "data"))
    from_parquet = load(str(export_parquet(tmp_path / "data", tmp_path / "d.parquet")))
    for graphs in (from_shards, from_parquet):
        np.testing.assert_array_equal(graphs.z, qm9.z[: off[n]])
        np.testing.assert_allclose(graphs.pos, qm9.pos[: off[n]], rtol=1e-6, atol=1e-6)  # Bohr -> Angstrom
        np.testing.assert_array_equal(graphs.natoms, qm9.natoms[:n])
        np.testing.assert_allclose(graphs.target, qm9.target[:n])
        assert list(graphs.group) == [f"S{i // 2}" for i in range(n)]  # conformers share their molecule's group
    assert len(load(str(tmp_path / "data"), limit=4)) == 4


def test_checkpoint_is_one_file_with_its_state(qm9, tmp_path):
    """State and arrays travel together; a stray or foreign file is refused with a clear message."""
    from schnet.train import CHECKPOINT, read_state

    out = tmp_path / "run"
    train(TrainConfig(config="tiny", steps=4, val_every=2, batch_size=8, num_val=40, out=str(out), progress=False), qm9)
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT, "learning_curve.png", "metrics.csv"]
    assert read_state(out).step == 4
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint of this version"):
        read_state(tmp_path / "foreign")
    with pytest.raises(FileNotFoundError, match="holds no SchNet checkpoint"):
        read_state(tmp_path / "empty")


KILL_ARGS = ["--config", "tiny", "--data", "qm9", "--limit", "300", "--steps", "300", "--num-val", "60",
             "--val-every", "10", "--warmup-steps", "5", "--no-progress"]  # fmt: skip


def _same_models(a, b) -> None:
    """The two run directories hold the same parameters and the same metrics rows."""
    (first, _), (second, _) = load_run(a), load_run(b)
    for x, y in zip(jax.tree.leaves(eqx.filter(first, eqx.is_array)), jax.tree.leaves(eqx.filter(second, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    rows = [[row.split(",")[:3] for row in (run / "metrics.csv").read_text().splitlines()] for run in (a, b)]
    assert rows[0] == rows[1]  # step, train loss, validation MAE: no row repeated or lost (seconds differ)


def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL a training process once it has written a checkpoint and before it ends; --resume then
    finishes with the parameters and metrics of a run that was never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    assert train_main([*KILL_ARGS, "--out", str(tmp_path / "whole")]) == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "schnet.cli", *KILL_ARGS, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (killed / "checkpoint.eqx").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    # killed part-way: fewer than the 30 validation rows of the whole run (none, if it died between its
    # first checkpoint and the metrics written after it)
    assert len(read_metrics(killed)) < 30
    assert train_main([*KILL_ARGS, "--out", str(killed), "--resume"]) == 0
    _same_models(tmp_path / "whole", killed)


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """A crash half-way through writing a checkpoint (here the arrays' serialisation fails after the
    header and some arrays are written) leaves the previous checkpoint whole; --resume continues from
    it to the uninterrupted result."""
    import schnet.train

    assert train_main([*KILL_ARGS, "--out", str(tmp_path / "whole")]) == 0
    serialise, calls = eqx.tree_serialise_leaves, []

    def crash_on_the_third(handle, tree):
        calls.append(1)
        if len(calls) == 3:
            handle.write(b"\0" * 1000)  # part of the arrays, then the process dies
            raise SystemExit("killed while writing a checkpoint")
        return serialise(handle, tree)

    monkeypatch.setattr(schnet.train.eqx, "tree_serialise_leaves", crash_on_the_third)
    crashed = tmp_path / "crashed"
    with pytest.raises(SystemExit, match="killed while writing"):
        train_main([*KILL_ARGS, "--out", str(crashed)])
    monkeypatch.undo()
    assert load_run(crashed)[1].step == 20  # the second checkpoint, whole
    assert train_main([*KILL_ARGS, "--out", str(crashed), "--resume"]) == 0
    _same_models(tmp_path / "whole", crashed)
