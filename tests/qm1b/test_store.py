"""qm1b.store: round trip, layout, resume, crash safety under SIGKILL, Parquet export and info.

The SIGKILL tests run writers (and compactions) in subprocesses that import this module for the
deterministic batch generator :func:`make_batch`, kill them at random moments and check that the
dataset holds exactly the committed batches, with the values make_batch produces.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from qm1b.schema import QM1B_COLUMNS, SCALAR_COLUMNS, Failure, RecordBatch
from qm1b.store import (
    CorruptFileError,
    ShardChangedError,
    ShardWriter,
    StorageError,
    compact,
    export_parquet,
    info,
    open_dataset,
    part_path,
    shard_path,
)

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "basis": "sto-3g",
    "xc": "b3lyp",
    "grid_level": 1,
    "precision": "float32",
    "iterations": 20,
    "seed": 7,
    "backend": "cpu",
}
VERSIONS = {"qm1b": "0.1.0", "numpy": np.__version__}
SYMBOLS = ["", "H", "He", "Li", "Be", "B", "C", "N", "O", "F"]
REASONS = ["bad SMILES", "embedding failed", "element Xe not in basis sto-3g"]
KILL_BATCH = 2000  # records per batch in the SIGKILL tests: large enough for kills to land mid-write


# ----------------------------------------------------------------------------- helpers


def make_batch(k: int, n: int = 16) -> tuple[RecordBatch, list[Failure]]:
    """Batch k: n valid random records (seeded by k, 1-29 atoms each) and 2 failures.

    Record keys are (1000 k + i // 2, i % 2); the failures are the whole molecule 1000 k + 999 and
    conformer 99 of molecule 1000 k.
    """
    rng = np.random.default_rng(k)
    natoms = rng.integers(1, 30, n)
    z = rng.integers(1, len(SYMBOLS), int(natoms.sum()))
    off = np.concatenate([[0], np.cumsum(natoms)])
    homo = rng.normal(-7.0, 1.0, n)
    lumo = homo + rng.uniform(0.5, 8.0, n)
    columns = {
        "smile": [f"C{'C' * int(a)}O" for a in natoms],
        "atoms": ["".join(SYMBOLS[x] for x in z[off[i] : off[i + 1]]) for i in range(n)],
        "energy": rng.normal(-2000.0, 300.0, n),
        "homo": homo,
        "lumo": lumo,
        "y": lumo - homo,
        "N": natoms * 5,
        "std": rng.uniform(0, 1e-4, n),
        "converged": rng.uniform(size=n) > 0.2,
        "iterations": rng.integers(5, 40, n),
        "seconds": rng.uniform(0.1, 2.0, n),
        "molecule_id": 1000 * k + np.arange(n) // 2,
        "conformer_id": np.arange(n) % 2,
    }
    records = RecordBatch.from_columns(columns, natoms, z, rng.normal(0, 3, (len(z), 3)))
    failures = [
        Failure(f"X{k}", REASONS[k % len(REASONS)], 1000 * k + 999),
        Failure(f"C{k}", "NaN label", 1000 * k, 99),
    ]
    return records, failures


def expected(batches: range, n: int = 16) -> tuple[RecordBatch, list[Failure]]:
    made = [make_batch(k, n) for k in batches]
    return RecordBatch.concat(r for r, _ in made), [f for _, fs in made for f in fs]


def keys_of(batch: RecordBatch, failures: list[Failure]) -> set[tuple[int, int]]:
    return set(batch.keys()) | {f.key for f in failures}


def assert_batches_equal(a: RecordBatch, b: RecordBatch) -> None:
    assert len(a) == len(b) and set(a.columns) == set(b.columns) >= set(SCALAR_COLUMNS)
    for name in a.columns:
        assert a.columns[name].dtype == b.columns[name].dtype, name
        np.testing.assert_array_equal(a.columns[name], b.columns[name], err_msg=name)
    np.testing.assert_array_equal(a.natoms, b.natoms)
    np.testing.assert_array_equal(a.z, b.z)
    np.testing.assert_array_equal(a.pos, b.pos)
    assert (a.forces is None) == (b.forces is None)
    if a.forces is not None:
        np.testing.assert_array_equal(a.forces, b.forces)


def sort_by_key(batch: RecordBatch) -> RecordBatch:
    return batch.take(np.lexsort((batch.columns["conformer_id"], batch.columns["molecule_id"])))


def assert_dataset(directory, batches: range, n: int = 16) -> None:
    """The dataset holds exactly make_batch(k, n) for k in batches, in that order."""
    want, want_failures = expected(batches, n)
    with open_dataset(directory) as ds:
        assert len(ds) == len(want)
        assert_batches_equal(ds.arrays(), want)
        assert ds.failures() == want_failures


def write(directory, batches: range, n: int = 16, close: bool = True, **kw) -> ShardWriter:
    writer = ShardWriter(directory, settings=SETTINGS, versions=VERSIONS, **kw)
    for k in batches:
        writer.commit(*make_batch(k, n))
    if close:
        writer.close()
    else:
        writer.abandon()
    return writer


def run_python(script: str, *args: str, kill_after: int | None = None, delay: float = 0.0, may_finish: bool = False):
    """Run script in a subprocess; SIGKILL it `delay` s after it printed kill_after lines.

    Returns every line it printed (also those printed between the last read and the kill).
    may_finish: the child may have ended successfully before the kill.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        if kill_after is None:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            return out.split()
        lines = []
        while len(lines) < kill_after:
            line = proc.stdout.readline()
            assert line, f"the child ended early: {proc.stderr.read()}"
            lines.append(line.strip())
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        finished = may_finish and proc.returncode == 0
        assert finished or proc.returncode == -signal.SIGKILL, f"not killed: {proc.stderr.read()}"
        return lines + proc.stdout.read().split()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# ---------------------------------------------------------------------------- round trip


def test_round_trip(tmp_path):
    write(tmp_path, range(5))
    want, want_failures = expected(range(5))
    assert len(set(want.natoms.tolist())) > 10  # varied molecule sizes
    with open_dataset(tmp_path) as ds:
        assert len(ds) == 5 * 16
        assert_batches_equal(ds.arrays(), want)
        assert ds.failures() == want_failures
        assert ds.attrs == {"settings": SETTINGS, "versions": VERSIONS, "schema_version": 1}
        records = list(ds.records())
        molecules = list(ds.molecules())
    assert [m for m, _ in molecules] == sorted(set(want.columns["molecule_id"].tolist()))
    assert all(len(b) == 2 and set(b.columns["molecule_id"].tolist()) == {m} for m, b in molecules)
    off = want.atom_offsets()
    for i in (0, 17, len(want) - 1):
        assert records[i]["smile"] == want.columns["smile"][i]
        assert records[i]["energy"] == want.columns["energy"][i]
        assert records[i]["converged"] == want.columns["converged"][i]
        np.testing.assert_array_equal(records[i]["z"], want.z[off[i] : off[i + 1]])
        np.testing.assert_array_equal(records[i]["pos"], want.pos[off[i] : off[i + 1]])
        assert records[i]["pos"].shape == (want.natoms[i], 3)


def test_to_pandas(tmp_path):
    pytest.importorskip("pandas")
    write(tmp_path, range(2))
    want, _ = expected(range(2))
    frame = open_dataset(tmp_path).to_pandas()
    assert list(frame.columns[: len(QM1B_COLUMNS)]) == list(QM1B_COLUMNS)
    assert len(frame) == 32 and "molecule_id" in frame.columns
    np.testing.assert_array_equal(frame["homo"].to_numpy(), want.columns["homo"])
    off = want.atom_offsets()
    np.testing.assert_array_equal(frame["pos"][5], want.pos[off[5] : off[6]])
    np.testing.assert_array_equal(frame["z"][31], want.z[off[31] :])


def test_merged_file_is_chunked_and_compressed(tmp_path):
    write(tmp_path, range(3))
    path = shard_path(tmp_path, 0, 1)
    assert sorted(os.listdir(tmp_path)) == [path.name]  # parts merged and removed, no lock left
    with h5py.File(path, "r") as f:
        names = [f"records/{k}" for k in f["records"]] + [f"failures/{k}" for k in f["failures"]]
        assert len(names) == len(SCALAR_COLUMNS) + 4 + 4
        for name in names:
            ds = f[name]
            assert ds.chunks is not None and ds.compression == "gzip" and ds.maxshape[0] is None, name
        assert f["records/pos"].shape == (int(f["records/natoms"][:].sum()), 3)
        natoms = f["records/natoms"][:]
        np.testing.assert_array_equal(f["records/atom_offset"][:], np.cumsum(natoms) - natoms)
        assert json.loads(f.attrs["merged_parts"]) == [0, 1, 2]
        assert json.loads(f.attrs["settings"]) == SETTINGS


def test_several_shards_in_order(tmp_path):
    for shard in (1, 0):
        w = ShardWriter(tmp_path, shard, 2, settings=SETTINGS, versions=VERSIONS)
        w.commit(*make_batch(shard))
        w.close()
    assert_dataset(tmp_path, range(2))
    other = tmp_path / "other"
    for shard, seed in ((0, 1), (1, 2)):
        w = ShardWriter(other, shard, 2, settings={**SETTINGS, "seed": seed}, versions=VERSIONS)
        w.close()
    with pytest.raises(ValueError, match="seed"):
        open_dataset(other)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no qm1b shards"):
        open_dataset(tmp_path / "empty")


# -------------------------------------------------------------------------------- resume


def test_resume(tmp_path):
    write(tmp_path, range(2))
    with pytest.raises(FileExistsError, match="--resume"):
        ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS)
    with pytest.raises(ValueError, match="basis"):
        ShardWriter(tmp_path, settings={**SETTINGS, "basis": "6-31g"}, versions=VERSIONS, resume=True)
    with pytest.raises(ValueError, match="extra"):
        ShardWriter(tmp_path, settings={**SETTINGS, "extra": 1}, versions=VERSIONS, resume=True)
    # a key the stored settings hold but that no longer defines a label (an older version's)
    older = tmp_path / "older"
    ShardWriter(older, settings={**SETTINGS, "tiles": 7}, versions=VERSIONS).close()
    with pytest.raises(ValueError, match="tiles"):
        ShardWriter(older, settings=SETTINGS, versions=VERSIONS, resume=True)
    ShardWriter(older, settings=SETTINGS, versions=VERSIONS, resume=True, ignored_settings=("tiles",)).close()
    # a value an older version spelled otherwise (--integrals device, now jax) is the same setting
    renamed = tmp_path / "renamed"
    ShardWriter(renamed, settings={**SETTINGS, "integrals": "device"}, versions=VERSIONS).close()
    ShardWriter(renamed, settings={**SETTINGS, "integrals": "jax"}, versions=VERSIONS, resume=True).close()
    with pytest.raises(ValueError, match="integrals"):
        ShardWriter(renamed, settings={**SETTINGS, "integrals": "libcint"}, versions=VERSIONS, resume=True)
    # a setting added since (the float64 refinement) reads, where an older version wrote none, as its value then
    added = tmp_path / "added"
    ShardWriter(added, settings=SETTINGS, versions=VERSIONS).close()
    ShardWriter(added, settings={**SETTINGS, "refine_commutator": 0.0}, versions=VERSIONS, resume=True).close()
    with pytest.raises(ValueError, match="refine_commutator"):
        ShardWriter(added, settings={**SETTINGS, "refine_commutator": 5e-7}, versions=VERSIONS, resume=True)
    writer = write(tmp_path, range(2, 4), close=False, resume=True)  # parts on top of a shard file
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, resume=True)
    made = [make_batch(k) for k in range(4)]
    assert writer.done() == set().union(*(keys_of(r, f) for r, f in made))
    assert writer.counts == {"records": 64, "failures": 8}
    with pytest.raises(ValueError, match="already committed"):
        writer.commit(*make_batch(1))
    writer.commit(*make_batch(4))
    writer.close()
    assert_dataset(tmp_path, range(5))


def test_one_writer_per_shard(tmp_path):
    first = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS)
    with pytest.raises(RuntimeError, match="another process"):
        ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, resume=True)
    first.commit(*make_batch(0))
    first.close()
    write(tmp_path, range(1, 2), resume=True)
    assert_dataset(tmp_path, range(2))


def test_context_manager_keeps_parts_on_error(tmp_path):
    with pytest.raises(KeyError):
        with ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS) as w:
            w.commit(*make_batch(0))
            raise KeyError("boom")
    assert not shard_path(tmp_path, 0, 1).exists() and part_path(shard_path(tmp_path, 0, 1), 0).exists()
    assert info(tmp_path)["unmerged_parts"] == 1
    assert_dataset(tmp_path, range(1))
    compact(tmp_path)
    assert info(tmp_path)["unmerged_parts"] == 0
    assert_dataset(tmp_path, range(1))


def test_reader_sees_parts_and_concurrent_compaction(tmp_path):
    write(tmp_path, range(2))
    write(tmp_path, range(2, 4), close=False, resume=True)  # shard file + 2 parts
    ds = open_dataset(tmp_path)
    assert len(ds) == 4 * 16 and ds.unmerged_parts == 2
    compact(tmp_path)  # a writer merges and deletes the parts this reader listed
    with pytest.raises(ShardChangedError, match="open the dataset again"):
        ds.arrays()
    ds.close()
    assert_dataset(tmp_path, range(4))


def test_leftover_tmp_files_are_ignored_then_removed(tmp_path):
    write(tmp_path, range(1))
    shard = shard_path(tmp_path, 0, 1)
    junk = [shard.with_name(shard.name + ".tmp"), part_path(shard, 7).with_suffix(".h5.tmp")]
    junk[1].parent.mkdir()
    for path in junk:
        path.write_bytes(b"\x89HDF half written")
    assert_dataset(tmp_path, range(1))
    write(tmp_path, range(1, 2), resume=True)
    assert not any(p.exists() for p in junk)
    assert_dataset(tmp_path, range(2))


# ------------------------------------------------------------------------- crash safety

WRITER_SCRIPT = """
import sys
from qm1b.store import ShardWriter
from tests.qm1b.test_store import SETTINGS, VERSIONS, keys_of, make_batch
out, total, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
writer = ShardWriter(out, settings=SETTINGS, versions=VERSIONS, resume=True)
done = writer.done()
for k in range(total):
    batch = make_batch(k, n)
    keys = keys_of(*batch)
    if keys <= done:
        continue
    assert not keys & done, f"batch {k} is partly committed"
    writer.commit(*batch)
    print(k, flush=True)
writer.close()
print("closed", flush=True)
"""


def test_sigkill_during_commits_then_resume(tmp_path):
    rng = np.random.default_rng(0)
    out, total = tmp_path / "killed", 24
    reported = -1
    for _ in range(3):
        lines = run_python(WRITER_SCRIPT, str(out), str(total), str(KILL_BATCH),
                           kill_after=int(rng.integers(1, 4)), delay=float(rng.uniform(0, 0.04)))  # fmt: skip
        reported = max([reported, *map(int, lines)])
        with open_dataset(out) as ds:
            committed = len(ds) // KILL_BATCH
        assert committed in (reported + 1, reported + 2)  # at most the in-flight batch beyond the reports
        assert_dataset(out, range(committed), KILL_BATCH)  # nothing lost, duplicated or corrupted
    assert reported + 1 < total
    lines = run_python(WRITER_SCRIPT, str(out), str(total), str(KILL_BATCH))
    assert lines[-1] == "closed" and int(lines[0]) >= reported + 1
    assert sorted(os.listdir(out)) == ["shard-00000-of-00001.h5"]
    assert_dataset(out, range(total), KILL_BATCH)
    whole = tmp_path / "whole"  # an uninterrupted run
    write(whole, range(total), KILL_BATCH)
    with open_dataset(out) as a, open_dataset(whole) as b:
        assert_batches_equal(sort_by_key(a.arrays()), sort_by_key(b.arrays()))
        assert sorted(a.failures(), key=lambda f: f.key) == sorted(b.failures(), key=lambda f: f.key)


COMPACT_SCRIPT = """
import sys
from qm1b.store import compact
print("start", flush=True)
compact(sys.argv[1])
print("done", flush=True)
"""


def test_sigkill_during_compact(tmp_path):
    write(tmp_path, range(10), KILL_BATCH, close=False)
    rng = np.random.default_rng(1)
    for low, high in ((0.0, 0.25), (0.25, 0.5), (0.5, 0.8)):  # compact takes about 0.7 s here
        run_python(COMPACT_SCRIPT, str(tmp_path), kill_after=1, delay=float(rng.uniform(low, high)), may_finish=True)
        assert_dataset(tmp_path, range(10), KILL_BATCH)
    assert run_python(COMPACT_SCRIPT, str(tmp_path)) == ["start", "done"]
    assert sorted(os.listdir(tmp_path)) == ["shard-00000-of-00001.h5"]
    assert_dataset(tmp_path, range(10), KILL_BATCH)


CLOSE_HOOK_SCRIPT = """
import sys, time
from qm1b import store
from tests.qm1b.test_store import SETTINGS, VERSIONS, make_batch

def pause(shard):
    print("replaced", flush=True)
    time.sleep(60)

store.writer._on_merge_replaced = pause  # between publishing the merged file and deleting its parts
writer = store.ShardWriter(sys.argv[1], settings=SETTINGS, versions=VERSIONS)
for k in range(3):
    writer.commit(*make_batch(k))
writer.close()
"""


def test_sigkill_between_merge_and_part_deletion(tmp_path):
    assert run_python(CLOSE_HOOK_SCRIPT, str(tmp_path), kill_after=1) == ["replaced"]
    shard = shard_path(tmp_path, 0, 1)
    assert shard.exists() and all(part_path(shard, k).exists() for k in range(3))  # merged, not yet deleted
    assert_dataset(tmp_path, range(3))  # the leftover parts are not read twice
    assert info(tmp_path)["unmerged_parts"] == 0
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, resume=True)
    assert not part_path(shard, 0).exists()  # stale parts removed on open
    writer.commit(*make_batch(3))
    assert part_path(shard, 3).exists()  # numbered after the merged parts, never reusing a number
    assert_dataset(tmp_path, range(4))
    writer.close()
    assert sorted(os.listdir(tmp_path)) == [shard.name]
    assert_dataset(tmp_path, range(4))


# ---------------------------------------------------------------------------- validation


def test_validate_names_the_column():
    records, _ = make_batch(0)
    records.validate()

    def broken(name, value) -> RecordBatch:
        return RecordBatch({**records.columns, name: value}, records.natoms, records.z, records.pos)

    homo = records.columns["homo"].copy()
    homo[3] = np.nan
    with pytest.raises(ValueError, match="homo"):
        broken("homo", homo).validate()
    with pytest.raises(ValueError, match="std"):
        broken("std", np.full(len(records), np.inf)).validate()
    with pytest.raises(ValueError, match="energy"):
        broken("energy", records.columns["energy"][:-1]).validate()
    with pytest.raises(ValueError, match="N"):
        broken("N", records.columns["N"].astype(np.float64)).validate()
    with pytest.raises(ValueError, match="y"):
        broken("y", records.columns["y"] + 0.1).validate()
    with pytest.raises(ValueError, match="pos"):
        RecordBatch(records.columns, records.natoms, records.z, records.pos[:-1]).validate()
    with pytest.raises(ValueError, match="converged"):
        columns = {k: v for k, v in records.columns.items() if k != "converged"}
        RecordBatch(columns, records.natoms, records.z, records.pos).validate()


def test_invalid_commit_writes_nothing(tmp_path):
    records, failures = make_batch(0)
    lumo = records.columns["lumo"].copy()
    lumo[0] = np.nan
    bad = RecordBatch({**records.columns, "lumo": lumo}, records.natoms, records.z, records.pos)
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS)
    with pytest.raises(ValueError, match="lumo"):
        writer.commit(bad, failures)
    assert writer.done() == set() and not (tmp_path / "shard-00000-of-00001.parts").exists()
    writer.commit(None, failures)
    writer.close()
    with open_dataset(tmp_path) as ds:
        assert len(ds) == 0 and ds.failures() == failures


# -------------------------------------------------------------------------- export, info


def test_export_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    write(tmp_path / "d", range(3))
    want, _ = expected(range(3))
    path = export_parquet(tmp_path / "d", tmp_path / "d.parquet")
    assert path == tmp_path / "d.parquet" and not (tmp_path / "d.parquet.tmp").exists()
    table = pq.read_table(path)
    assert table.column_names == list(QM1B_COLUMNS)
    assert str(table.schema.field("z").type) == "list<element: int8>"
    assert str(table.schema.field("pos").type) == "list<element: float>"
    for name in ("smile", "atoms", "energy", "homo", "lumo", "y", "N", "std"):
        values = table.column(name).to_numpy(zero_copy_only=False)
        np.testing.assert_array_equal(values, want.columns[name], err_msg=name)
    pos = table.column("pos").to_pylist()
    assert [len(p) for p in pos] == (3 * want.natoms).tolist()
    np.testing.assert_array_equal(np.concatenate(pos).astype(np.float32), want.pos.reshape(-1))
    np.testing.assert_array_equal(np.concatenate(table.column("z").to_pylist()), want.z)
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(path)
    assert list(frame.columns) == list(QM1B_COLUMNS)
    off = want.atom_offsets()
    np.testing.assert_array_equal(frame["pos"][7], want.pos[off[7] : off[8]].reshape(-1))


def test_info(tmp_path):
    columns = {
        "smile": ["C", "C", "O", "CO"],
        "atoms": ["CH", "CHH", "O", "CO"],
        "energy": [-10.0, -30.0, -5.0, -40.0],
        "homo": [-8.0, -7.0, -9.0, -6.0],
        "lumo": [-1.0, -2.0, 1.0, -4.0],
        "y": [7.0, 5.0, 10.0, 2.0],
        "N": [5, 6, 5, 10],
        "std": [0.0, 1e-5, 2e-5, 3e-5],
        "converged": [True, False, True, True],
        "iterations": [10, 50, 12, 20],
        "seconds": [0.5, 1.5, 1.0, 2.0],
        "molecule_id": [0, 0, 1, 2],
        "conformer_id": [0, 1, 0, 0],
    }
    records = RecordBatch.from_columns(columns, [2, 3, 1, 2], [6, 1, 6, 1, 1, 8, 6, 8], np.zeros((8, 3)))
    failures = [
        Failure("Xe", "bad SMILES", 3),
        Failure("[Hg]", "bad SMILES", 4),
        Failure("CC", "embedding failed", 5, 1),
    ]
    writer = ShardWriter(tmp_path, 0, 2, settings=SETTINGS, versions=VERSIONS)
    writer.commit(records.take([0, 1, 2]), failures[:2])
    writer.commit(records.take([3]), failures[2:])
    writer.abandon()  # left as parts
    stats = info(tmp_path)
    assert stats["records"] == 4 and stats["failures"] == 3
    assert stats["molecules"] == 3 and stats["failed_molecules"] == 2
    assert stats["shards"] == 1 and stats["num_shards"] == 2 and stats["unmerged_parts"] == 2
    assert stats["convergence_rate"] == 0.75
    assert stats["failure_reasons"] == {"bad SMILES": 2, "embedding failed": 1}
    per_atom = [-5.0, -10.0, -5.0, -20.0]  # energy / natoms
    want = {"mean": -10.0, "std": pytest.approx(np.std(per_atom)), "min": -20.0, "max": -5.0}
    assert stats["labels"]["energy_per_atom"] == want
    assert stats["labels"]["y"]["mean"] == 6.0 and stats["labels"]["homo"]["max"] == -6.0
    assert stats["iterations"] == {"mean": 23.0, "max": 50}
    # 4 conformers in 5 worker-seconds: 2880 per hour
    assert stats["throughput"] == {"conformers_per_hour_per_worker": 2880.0, "seconds_per_conformer": 1.25,
                                   "worker_hours": pytest.approx(5 / 3600)}  # fmt: skip
    assert stats["settings"] == SETTINGS
    compact(tmp_path)
    assert {**stats, "unmerged_parts": 0} == info(tmp_path)
    json.dumps(stats)  # serializable as it is


# ------------------------------------------------------------------- failures of the disk and files


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "300k", options: str = ""):
    """A tmpfs of ``size`` mounted on ``directory`` (a real full disk); skips where mounting is not allowed."""
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(directory)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_full_disk_is_one_storage_error_and_resume_completes(tmp_path):
    """On a 300 KB tmpfs the commits run out of space: one StorageError naming the directory and the
    cause, every committed part intact and no temporary file left; --resume on a larger disk (the
    directory copied) completes the shard as if nothing had happened."""
    import shutil

    with small_disk(tmp_path / "disk") as disk:
        out = disk / "out"
        writer = ShardWriter(out, settings=SETTINGS, versions=VERSIONS)
        committed = 0
        with pytest.raises(StorageError) as caught:
            for k in range(100):
                writer.commit(*make_batch(k, n=256))
                committed += 1
        writer.abandon()
        assert str(caught.value) == f"cannot write to {out}: {os.strerror(errno.ENOSPC)}"
        assert 0 < committed < 100
        assert not list(out.rglob("*.tmp"))
        assert_dataset(out, range(committed), n=256)  # what was committed is readable as it was
        shutil.copytree(out, tmp_path / "big")
    write(tmp_path / "big", range(committed, 100), n=256, close=False, resume=True)
    compact(tmp_path / "big")
    assert_dataset(tmp_path / "big", range(100), n=256)


def test_process_survives_a_full_disk(tmp_path):
    """A process that met a full disk ends normally, silently: HDF5 never wrote to the disk itself
    (a failed HDF5 write leaves its file open, prints errors as its objects are freed, and crashed
    the interpreter at exit)."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.qm1b.test_store import SETTINGS, VERSIONS, make_batch
from qm1b.store import ShardWriter, StorageError
writer = ShardWriter(sys.argv[1], settings=SETTINGS, versions=VERSIONS)
try:
    for k in range(100):
        writer.commit(*make_batch(k, n=256))
except StorageError:
    writer.abandon()
    print("full after", k)
"""
    with small_disk(tmp_path / "disk") as disk:
        done = subprocess.run([sys.executable, "-c", script, str(disk / "out")], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("full after")


def test_read_only_directory_is_one_storage_error(tmp_path):
    """A writer, and a Parquet export, into a read-only file system: one StorageError naming the place."""
    write(tmp_path / "data", range(1))
    with small_disk(tmp_path / "ro", options=",ro") as disk:
        with pytest.raises(StorageError, match=f"cannot write to {disk / 'out'}: {os.strerror(errno.EROFS)}"):
            ShardWriter(disk / "out", settings=SETTINGS, versions=VERSIONS)
        with pytest.raises(StorageError, match=f"cannot write to {disk}: {os.strerror(errno.EROFS)}"):
            export_parquet(tmp_path / "data", disk / "d.parquet")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["full disk", "permission"])
def test_write_errors_without_a_small_disk(tmp_path, monkeypatch, code):
    """The same StorageError where no tmpfs can be mounted (a full disk, simulated), and for a
    permission error (which root, running this suite in CI, never meets)."""
    from qm1b.store import writer as store_writer

    write(tmp_path, range(2), close=False)
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, resume=True)

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_writer, "write_atomically", refuse)
    with pytest.raises(StorageError, match=f"cannot write to {tmp_path}: {os.strerror(code)}"):
        writer.commit(*make_batch(2))
    writer.abandon()
    assert_dataset(tmp_path, range(2))


def truncate(path: Path) -> None:
    """Cut ``path`` to half its size, as an interrupted copy leaves it."""
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("damaged", ["part", "shard file"])
def test_corrupt_file_is_named_by_readers_and_redone_by_resume(tmp_path, damaged):
    """A truncated part (or merged shard file): open_dataset, info and export name it; a resuming
    writer sets it aside as NAME.corrupt and no longer counts its rows as done, so they are computed
    and committed again; the dataset is then whole."""
    write(tmp_path, range(2))  # merged into the shard file
    write(tmp_path, range(2, 4), close=False, resume=True)  # parts 2 and 3 on top of it
    bad = part_path(shard_path(tmp_path, 0, 1), 3) if damaged == "part" else shard_path(tmp_path, 0, 1)
    truncate(bad)
    for read in (open_dataset, info, lambda d: export_parquet(d, tmp_path / "x.parquet")):
        with pytest.raises(CorruptFileError, match=f"{bad} is truncated or corrupt"):
            read(tmp_path)
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, resume=True)
    assert [(old, new.name) for old, new in writer.set_aside] == [(bad, bad.name + ".corrupt")]
    redo = [3] if damaged == "part" else [0, 1]
    lost = set().union(*(keys_of(*make_batch(k)) for k in redo))
    assert not lost & writer.done() and writer.done()  # its rows are to do again, the others are not
    for k in redo:
        writer.commit(*make_batch(k))
    writer.close()
    with open_dataset(tmp_path) as ds:
        assert_batches_equal(sort_by_key(ds.arrays()), sort_by_key(expected(range(4))[0]))


def with_optional(records: RecordBatch, k: int) -> tuple[RecordBatch, RecordBatch]:
    """``records`` with forces and an optimizer_steps column, and two trajectory frames of each."""
    rng = np.random.default_rng(100 + k)
    forces = rng.normal(size=records.pos.shape).astype(np.float32)
    relaxed = RecordBatch({**records.columns, "optimizer_steps": np.full(len(records), 2, np.int16)}, records.natoms,
                          records.z, records.pos, forces)  # fmt: skip
    both = RecordBatch.concat([records, records])
    frames = RecordBatch({**both.columns, "step": np.repeat([0, 1], len(records)).astype(np.int16)}, both.natoms,
                         both.z, both.pos, np.concatenate([forces, forces]))  # fmt: skip
    return relaxed, frames


def test_optional_columns_and_frames_survive_failure_only_parts_and_the_merge(tmp_path):
    """A shard laid out with forces, optimizer_steps and frames: a part of failures alone (a bad
    input) merges with parts of records (the layout is the writer's, not each batch's), and the
    records and frames read back as committed."""
    layout = frozenset({"forces", "optimizer_steps", "frames"})
    writer = ShardWriter(tmp_path, settings=SETTINGS, versions=VERSIONS, layout=layout)
    _, failures = make_batch(0)
    writer.commit(None, failures)
    committed = []
    for k in (1, 2):
        records, _ = make_batch(k)
        relaxed, frames = with_optional(records, k)
        writer.commit(relaxed, [], frames)
        committed.append((relaxed, frames))
    writer.close()
    with open_dataset(tmp_path) as ds:
        assert_batches_equal(ds.arrays(), RecordBatch.concat([r for r, _ in committed]))
        assert_batches_equal(RecordBatch.concat(list(ds.frames())), RecordBatch.concat([f for _, f in committed]))
        assert len(ds.failures()) == 2
