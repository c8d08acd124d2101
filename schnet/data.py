"""Training data for SchNet: ragged graph sets, splits by molecule, and fixed-shape padded batches.

Sources:

- ``qm9``: QM9 read offline from ``qm9pack`` (:mod:`pyscf_ipu.qm9`); the target is its
  B3LYP/6-31G(2df,p) HOMO-LUMO gap converted to eV.
- a qm1b dataset directory (HDF5 shards, :func:`qm1b.open_dataset`) or a QM1B-format Parquet
  file: the target is the column ``y`` (gap, eV), positions are converted from Bohr.

A :class:`GraphSet` keeps every graph ragged (atoms flat, plus counts). Batches are padded to a
fixed number of graphs and of atoms per graph, with masks, so one compiled train step serves them
all; a padded atom has z = 0, a padded graph weight 0 in the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from pyscf_ipu.units import BOHR_PER_ANGSTROM, HARTREE_TO_EV


@dataclass(frozen=True)
class GraphSet:
    """n graphs, ragged: atoms flat in graph order."""

    z: np.ndarray  # (M,) atomic numbers
    pos: np.ndarray  # (M, 3) Angstrom
    natoms: np.ndarray  # (n,)
    target: np.ndarray  # (n,) eV
    group: np.ndarray  # (n,) str: the molecule (SMILES); a split never puts one group on both sides

    def __len__(self) -> int:
        return len(self.natoms)

    @property
    def offsets(self) -> np.ndarray:
        """(n + 1,): graph i's atoms are [off[i], off[i + 1])."""
        return np.concatenate([[0], np.cumsum(self.natoms, dtype=np.int64)])

    @property
    def max_atoms(self) -> int:
        return int(self.natoms.max()) if len(self) else 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """B graphs padded to A atoms each."""

    z: jax.Array  # (B, A) int32, 0 on padding
    pos: jax.Array  # (B, A, 3) float32, Angstrom
    atom_mask: jax.Array  # (B, A) bool
    target: jax.Array  # (B,) float32, eV
    graph_mask: jax.Array  # (B,) bool


def pad_batch(graphs: GraphSet, indices, batch_size: int, max_atoms: int) -> Batch:
    """Graphs ``indices`` (at most ``batch_size``) padded to (batch_size, max_atoms)."""
    indices = np.asarray(indices, np.int64)
    if len(indices) > batch_size:
        raise ValueError(f"{len(indices)} graphs do not fit a batch of {batch_size}")
    if len(indices) and graphs.natoms[indices].max() > max_atoms:
        raise ValueError(f"a graph has {graphs.natoms[indices].max()} atoms, more than max_atoms={max_atoms}")
    z = np.zeros((batch_size, max_atoms), np.int32)
    pos = np.zeros((batch_size, max_atoms, 3), np.float32)
    target = np.zeros(batch_size, np.float32)
    off = graphs.offsets
    for row, g in enumerate(indices):
        n = graphs.natoms[g]
        z[row, :n] = graphs.z[off[g] : off[g + 1]]
        pos[row, :n] = graphs.pos[off[g] : off[g + 1]]
        target[row] = graphs.target[g]
    graph_mask = np.arange(batch_size) < len(indices)
    return Batch(z, pos, z > 0, target, graph_mask)


def batches(graphs: GraphSet, indices, batch_size: int, max_atoms: int, *, seed: int | None = None,
            start: int = 0) -> Iterator[Batch]:  # fmt: skip
    """Endless batches over ``indices``: reshuffled every epoch from ``seed`` (None: in order, one pass).

    ``start`` skips that many batches, so a resumed run continues where it stopped.
    """
    indices = np.asarray(indices, np.int64)
    if seed is None:
        chunks = (indices[i : i + batch_size] for i in range(0, len(indices), batch_size))
        yield from (pad_batch(graphs, c, batch_size, max_atoms) for c in itertools.islice(chunks, start, None))
        return
    per_epoch = len(indices) // batch_size  # full batches only while training
    if per_epoch == 0:
        raise ValueError(f"{len(indices)} training graphs do not fill one batch of {batch_size}")
    for step in itertools.count(start):
        epoch, k = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(indices)
        yield pad_batch(graphs, order[k * batch_size : (k + 1) * batch_size], batch_size, max_atoms)


def split_by_group(graphs: GraphSet, *, val: float | int, test: float | int = 0, train: float | int | None = None,
                   seed: int = 0) -> dict[str, np.ndarray]:  # fmt: skip
    """Indices of train/val/test with no group (molecule) on two sides; deterministic from ``seed``.

    Sizes count graphs: an int is a number, a float a fraction of all graphs; ``train=None`` takes
    the rest. Groups are shuffled, then assigned whole: val first, then test, then train, each until
    it reaches its size (so a side may exceed its size by less than one group).
    """
    n = len(graphs)

    def size(x) -> int:
        return int(round(x * n)) if isinstance(x, float) else int(x)

    groups, inverse = np.unique(graphs.group, return_inverse=True)
    order = np.random.default_rng(seed).permutation(len(groups))
    members = [[] for _ in groups]
    for i, g in enumerate(inverse):
        members[g].append(i)
    wanted = {"val": size(val), "test": size(test), "train": n if train is None else size(train)}
    out: dict[str, list[int]] = {k: [] for k in wanted}
    names = iter(wanted)
    side = next(names)
    for g in order:
        while len(out[side]) >= wanted[side]:
            side = next(names, None)
            if side is None:
                break
        if side is None:
            break
        out[side].extend(members[g])
    return {k: np.sort(np.asarray(v, np.int64)) for k, v in out.items()}


def load_qm9(limit: int | None = None) -> GraphSet:
    """The first ``limit`` QM9 molecules (all 130,831 if None), target: HOMO-LUMO gap in eV."""
    from pyscf_ipu.qm9 import iter_qm9

    records = list(itertools.islice(iter_qm9(), limit))
    return GraphSet(
        z=np.concatenate([r.molecule.atomic_numbers for r in records]).astype(np.int32),
        pos=(np.concatenate([r.molecule.positions for r in records]) / BOHR_PER_ANGSTROM).astype(np.float32),
        natoms=np.array([r.molecule.natom for r in records]),
        target=np.array([(r.lumo_hartree - r.homo_hartree) * HARTREE_TO_EV for r in records]),
        group=np.array([r.smiles for r in records]),
    )


def load_qm1b(path: str | Path) -> GraphSet:
    """A qm1b dataset directory (HDF5 shards) or a QM1B-format Parquet file; target ``y`` (eV)."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["smile", "z", "pos", "y"])
        z = table.column("z").combine_chunks()
        natoms = np.diff(z.offsets.to_numpy())
        flat_pos = table.column("pos").combine_chunks().values.to_numpy(zero_copy_only=False)
        return GraphSet(z=z.values.to_numpy().astype(np.int32), pos=flat_pos.reshape(-1, 3) / BOHR_PER_ANGSTROM,
                        natoms=natoms, target=table.column("y").to_numpy(), group=np.array(table.column("smile").to_pylist()))  # fmt: skip
    from qm1b import open_dataset

    with open_dataset(path) as dataset:
        arrays = dataset.arrays()
    return GraphSet(
        z=arrays.z.astype(np.int32),
        pos=(arrays.pos / BOHR_PER_ANGSTROM).astype(np.float32),
        natoms=np.asarray(arrays.natoms),
        target=np.asarray(arrays.columns["y"], np.float64),
        group=np.asarray(arrays.columns["smile"], str),
    )


def load(source: str, limit: int | None = None) -> GraphSet:
    """``qm9`` or a path to a qm1b directory / Parquet file."""
    if source == "qm9":
        return load_qm9(limit)
    graphs = load_qm1b(source)
    if limit is not None and limit < len(graphs):
        keep = np.arange(limit)
        off = graphs.offsets
        return GraphSet(graphs.z[: off[limit]], graphs.pos[: off[limit]], graphs.natoms[keep], graphs.target[keep],
                        graphs.group[keep])  # fmt: skip
    return graphs
