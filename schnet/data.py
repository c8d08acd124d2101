"""Training data for SchNet: ragged graph sets, splits by molecule, and fixed-shape padded batches.

Sources:

- ``qm9``: QM9 read offline from ``qm9pack`` (:mod:`pyscf_ipu.qm9`); the target is its
  B3LYP/6-31G(2df,p) HOMO-LUMO gap converted to eV.
- a qm1b dataset directory (HDF5 shards, :func:`qm1b.open_dataset`) or a QM1B-format Parquet
  file: the target is the column ``y`` (gap, eV), positions are converted from Bohr.

A :class:`GraphSet` keeps every graph ragged (atoms flat, plus counts). A batch holds its atoms flat
too, each tagged with its graph, padded to a fixed :class:`Layout` (graphs, atoms, neighbour pairs),
so one compiled train step serves every batch; a padded atom has z = 0, a padded graph weight 0 in
the loss. Graphs are packed into batches greedily, so that the neighbour pairs the model will find
(counted on the host by :func:`pair_count`) fit the pair budget: only real pairs cost filter
evaluations.
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

    def atom_indices(self, indices) -> np.ndarray:
        """The flat indices of the atoms of graphs ``indices``, graph after graph."""
        off = self.offsets
        return np.concatenate([np.arange(off[g], off[g + 1]) for g in indices]) if len(indices) else np.zeros(0, int)

    def take(self, indices) -> GraphSet:
        """The graphs at ``indices``, in that order."""
        indices = np.asarray(indices, np.int64)
        atoms = self.atom_indices(indices)
        return GraphSet(self.z[atoms], self.pos[atoms], self.natoms[indices], self.target[indices], self.group[indices])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """Up to B graphs with their atoms flat, padded to N atoms (see :class:`Layout`)."""

    z: jax.Array  # (N,) int32, 0 on padding
    pos: jax.Array  # (N, 3) float32, Angstrom
    atom_mask: jax.Array  # (N,) bool
    graph_index: jax.Array  # (N,) int32: the graph (row of target) of each atom
    target: jax.Array  # (B,) float32, eV
    graph_mask: jax.Array  # (B,) bool


@dataclass(frozen=True)
class Layout:
    """The fixed shape of every batch: at most ``graphs`` graphs, ``atoms`` atoms and ``pairs``
    neighbour pairs (:func:`schnet.model.neighbour_pairs`), and no graph larger than ``graph_atoms``
    atoms (the model's neighbour window)."""

    graphs: int
    atoms: int
    pairs: int
    graph_atoms: int


EDGE_MARGIN = 1e-4  # Angstrom: host counts include near-ties, so they bound the float32 count in jit


def pair_count(graphs: GraphSet, neighbours: int | None, cutoff: float) -> np.ndarray:
    """(n,) neighbour pairs of each graph under the model's rule (:func:`schnet.model.neighbour_pairs`).

    A pair {i, j} counts once if either atom receives from the other. Computed in float64, with
    pairs within EDGE_MARGIN of the cutoff or of the k-th distance counted too, so the result is an
    upper bound of what the float32 computation finds.
    """
    off = graphs.offsets
    out = np.zeros(len(graphs), np.int64)
    for g in range(len(graphs)):
        pos = graphs.pos[off[g] : off[g + 1]].astype(np.float64)
        n = len(pos)
        d = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
        np.fill_diagonal(d, np.inf)
        keep = d < cutoff + EDGE_MARGIN  # (n, n): i receives from j
        if neighbours is not None and neighbours < n - 1:
            kth = np.sort(d, axis=1)[:, neighbours - 1]
            keep &= d <= kth[:, None] + EDGE_MARGIN
        out[g] = np.count_nonzero(np.triu(keep | keep.T, 1))
    return out


def layout_for(graphs: GraphSet, pairs: np.ndarray, batch_size: int, sigmas: float = 4.0) -> Layout:
    """Budgets for batches of ``batch_size`` random graphs: the mean atoms and pairs plus ``sigmas`` sd.

    A batch of B graphs drawn at random holds B mean +- sqrt(B) sd atoms (and pairs), so at 4 sd
    a few batches in 100,000 are cut short by a budget; padding is what the compiled step
    computes in vain, so the budgets stay that tight. The largest graph always fits. Rounded up to
    multiples of 32.
    """

    def budget(per_graph: np.ndarray) -> int:
        need = batch_size * per_graph.mean() + sigmas * per_graph.std() * np.sqrt(batch_size)
        need = max(int(np.ceil(need)), int(per_graph.max()), 1)
        return -(-need // 32) * 32

    return Layout(batch_size, budget(graphs.natoms), budget(pairs), graphs.max_atoms)


def pack(order: np.ndarray, graphs: GraphSet, pairs: np.ndarray, layout: Layout) -> list[np.ndarray]:
    """Cut ``order`` into consecutive batches that fit ``layout`` (greedy; the order is kept)."""
    out, current, atoms, count = [], [], 0, 0
    for g in order:
        n, e = int(graphs.natoms[g]), int(pairs[g])
        if current and (len(current) == layout.graphs or atoms + n > layout.atoms or count + e > layout.pairs):
            out.append(np.asarray(current, np.int64))
            current, atoms, count = [], 0, 0
        current.append(g)
        atoms, count = atoms + n, count + e
    if current:
        out.append(np.asarray(current, np.int64))
    return out


def pad_batch(graphs: GraphSet, indices, layout: Layout) -> Batch:
    """Graphs ``indices`` with their atoms flat, padded to ``layout``."""
    indices = np.asarray(indices, np.int64)
    natoms = graphs.natoms[indices]
    if len(indices) > layout.graphs or natoms.sum() > layout.atoms or (len(natoms) and natoms.max() > layout.graph_atoms):
        raise ValueError(f"{len(indices)} graphs with {natoms.sum()} atoms (the largest {natoms.max()}) do not fit {layout}")
    atoms = graphs.atom_indices(indices)
    m = len(atoms)
    z = np.zeros(layout.atoms, np.int32)
    pos = np.zeros((layout.atoms, 3), np.float32)
    graph_index = np.full(layout.atoms, max(len(indices) - 1, 0), np.int32)  # padding: zero output anyway
    z[:m], pos[:m] = graphs.z[atoms], graphs.pos[atoms]
    graph_index[:m] = np.repeat(np.arange(len(indices)), natoms)
    target = np.zeros(layout.graphs, np.float32)
    target[: len(indices)] = graphs.target[indices]
    return Batch(z, pos, z > 0, graph_index, target, np.arange(layout.graphs) < len(indices))


def batches(graphs: GraphSet, indices, pairs: np.ndarray, layout: Layout, *, seed: int | None = None,
            start: int = 0) -> Iterator[Batch]:  # fmt: skip
    """Batches over ``indices``: reshuffled every epoch from ``seed`` and endless, or (seed None) one pass in order.

    ``start`` skips that many batches, so a resumed run continues where it stopped.
    """
    indices = np.asarray(indices, np.int64)
    if seed is None:
        yield from (pad_batch(graphs, b, layout) for b in itertools.islice(pack(indices, graphs, pairs, layout), start, None))
        return
    if not len(indices):
        raise ValueError("no training graphs")
    skipped = 0
    for epoch in itertools.count():
        chunks = pack(np.random.default_rng([seed, epoch]).permutation(indices), graphs, pairs, layout)
        if skipped + len(chunks) <= start:  # this whole epoch was done before
            skipped += len(chunks)
            continue
        for chunk in chunks[max(start - skipped, 0) :]:
            yield pad_batch(graphs, chunk, layout)
        skipped += len(chunks)


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

        table = pq.read_table(path, columns=["smile", "atoms", "z", "pos", "y"])
        z = table.column("z").combine_chunks()
        natoms = np.diff(z.offsets.to_numpy())
        flat_pos = table.column("pos").combine_chunks().values.to_numpy(zero_copy_only=False)
        atoms = table.column("atoms").to_pylist()
        group = _groups(table.column("smile").to_pylist(), [f"atoms {a}" for a in atoms])
        return GraphSet(z=z.values.to_numpy().astype(np.int32), pos=flat_pos.reshape(-1, 3) / BOHR_PER_ANGSTROM,
                        natoms=natoms, target=table.column("y").to_numpy(), group=group)  # fmt: skip
    from qm1b import open_dataset

    with open_dataset(path) as dataset:
        arrays = dataset.arrays()
    return GraphSet(
        z=arrays.z.astype(np.int32),
        pos=(arrays.pos / BOHR_PER_ANGSTROM).astype(np.float32),
        natoms=np.asarray(arrays.natoms),
        target=np.asarray(arrays.columns["y"], np.float64),
        group=_groups(arrays.columns["smile"], [f"molecule {m}" for m in arrays.columns["molecule_id"]]),
    )


def _groups(smiles, fallback) -> np.ndarray:
    """(n,) str: each record's molecule, for splits: its SMILES, or where a dataset labelled geometry
    files that gave none, ``fallback`` (the molecule id; in a Parquet export, the atoms in order)."""
    return np.array([s or f for s, f in zip(smiles, fallback)], str)


def load(source: str, limit: int | None = None) -> GraphSet:
    """``qm9`` or a path to a qm1b directory / Parquet file."""
    if source == "qm9":
        return load_qm9(limit)
    graphs = load_qm1b(source)
    return graphs.take(np.arange(limit)) if limit is not None and limit < len(graphs) else graphs
