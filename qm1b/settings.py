"""The generator's settings: what to generate and how (:class:`GenerateConfig`, which the command line
is made from), resolved once with the DFT settings into a :class:`Run`, and the record of everything
that defines the labels, written into the dataset and read back by the same code
(:meth:`Run.label_settings`, :func:`dft_config`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from dataclasses import dataclass

from pyscf_ipu.config import COMMAND_LINE_DEFAULTS, MAX_STEPS, Criteria, IPUConfig, RKSConfig, option
from pyscf_ipu.memory import default_budget
from pyscf_ipu.method import Method
from pyscf_ipu.programs import MATMUL_PRECISION, device_description

from .conformers import ConformerSource, EmbeddedConformers, FileConformers
from .inputs import Input, parse_range, parse_shard
from .presets import PRESETS

EXECUTORS = ("local", "ray")
# The generator's own DFT defaults where they differ from a single point's:
# - QM1B's functional, B3LYP with the VWN5 correlation term (PySCF 2.2's "b3lyp"; since PySCF 2.3
#   "b3lyp" means the VWN-RPA variant, which single points keep as PySCF's default);
# - the JAX integrals, assembled on the device batch by batch, which label a stream of conformers faster
#   than libcint's, cold and restarted (benchmarks/realistic.py), with libcint's density-fitting factor
#   where the device is this CPU (``auto``); a single point keeps libcint's, the reference;
# - and, as ``pyscf-ipu run``, ``--jk auto`` (:func:`pyscf_ipu.config.auto_jk`).
GENERATOR_DFT_DEFAULTS: dict = {**COMMAND_LINE_DEFAULTS, "integrals": "auto", "xc": "b3lyp5"}
# Conformers the convergence watch judges together (or a batch, if larger): four molecules' worth at
# the default 8 conformers, so that one molecule whose conformers all fail cannot stop a run.
CONVERGENCE_WINDOW = 32



@dataclass(frozen=True)
class GenerateConfig:
    """What to generate and how; the DFT settings are a separate :class:`RKSConfig`."""

    smiles: str | None = option(None, "SMILES file (.smi: 'SMILES [id]' per line; or .csv with a smiles column); "
                              "default: the built-in sample of ~100 GDB-like molecules", metavar="FILE")  # fmt: skip
    geometries: str | None = option(None, "label these geometries instead of SMILES: an XYZ file (one frame per "
                                    "conformer, frames of one molecule in a row; QM9's files too), an SDF file, "
                                    "qm9pack's CSV, or a directory of XYZ and SDF files; no RDKit needed",
                                    metavar="FILE")  # fmt: skip
    out: str = option("data/generated", "output directory (one HDF5 file per shard)", metavar="DIR")
    preset: str | None = option(None, "a dataset's level of theory, whose functional, basis, grid, dispersion and "
                                "precision become those options' defaults (any of them given beside it wins): "
                                + "; ".join(f"{p.name}: {p.source}" for p in PRESETS.values()),
                                choices=tuple(PRESETS))  # fmt: skip
    conformers: int = option(8, "RDKit ETKDG conformers per molecule (SMILES input)")
    seed: int = option(1, "seed; each molecule's conformer seed is derived from it (never 0; SMILES input)")
    batch_size: int | None = option(None, "conformers per vmapped DFT batch; auto (the default): 8 on a CPU (1 "
                                    "with --jk df), and on a GPU the most whose arrays fit its memory, up to the "
                                    "size bucket's conformers; either at most what fits --memory-budget",
                                    auto=True)  # fmt: skip
    limit: int | None = option(None, "at most this many molecules (of this shard, after filtering)")
    heavy_atoms: str | None = option(None, "keep molecules with this many heavy atoms, e.g. 9-11")
    relax: str | None = option(None, "relax the conformers before labelling them (QM1B: none): mmff, MMFF94 (SMILES "
                               "input); dft, at the run's own functional, basis and grid, many conformers at once, each "
                               "with its own geomeTRIC optimiser (TRIC coordinates) and forces with the grid's response, "
                               f"converged when {Criteria().describe()} (geomeTRIC's defaults); a conformer that does "
                               "not converge, or whose atoms collide or fly apart, is recorded as a failure",
                               choices=("mmff", "dft"))  # fmt: skip
    max_steps: int = option(MAX_STEPS, "--relax dft: optimiser steps after the start before a conformer counts as "
                            "not converged")  # fmt: skip
    trajectory: bool = option(False, "--relax dft: also store every step of each relaxation (its geometry, labels and "
                              "forces) as frames, linked to the conformer by molecule_id, conformer_id and step")  # fmt: skip
    shard: str = option("0/1", "process shard i of n (i/n), e.g. for job arrays")
    resume: bool = option(False, "continue an interrupted run in --out")
    drop_unconverged: bool = option(False, "drop conformers that did not converge (recorded as failures)")
    min_converged: float = option(0.5, "stop the run (exit code 4) once fewer than this share of the last conformers "
                                  f"converged (at least {CONVERGENCE_WINDOW} of them, or a batch): a broken setup, "
                                  "not hard molecules; 0 never stops (fixed iteration counts)")  # fmt: skip
    forces: bool = option(False, "add a forces column (eV/Bohr, -dE/dR of the energy as computed, exact or density "
                                 "fitted; the SCF continues in float64 to converged orbitals first, --refine-commutator)")  # fmt: skip
    executor: str = option("local", "run in this process, or as many small Ray tasks that free workers pull",
                           choices=EXECUTORS)  # fmt: skip
    ray_address: str | None = option(None, "Ray cluster to join (default: start a local Ray with this "
                                     "machine's cores)", metavar="ADDR")  # fmt: skip
    task_molecules: int = option(4, "molecules per Ray task (--executor ray); each task writes its own shard")
    task_threads: int = option(1, "threads (XLA and OpenMP) and Ray CPUs per task (--executor ray)")
    progress: bool = option(True, "show a progress bar")
    report: str | None = option(None, "also write the run's summary as JSON to this file (counts, seconds, the "
                                "wall and host CPU time by stage)", metavar="FILE")  # fmt: skip
    memory_budget: float | None = option(None, "GB: refuse a run whose largest batch (with the next one prepared "
                                         "beside it) would need more (default: 80%% of this machine's memory)",
                                         metavar="GB")  # fmt: skip

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"--memory-budget is in GB and must be positive, got {self.memory_budget}")
        for name in ("conformers", "batch_size", "task_molecules", "task_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if parse_shard(self.shard) != (0, 1) and self.executor == "ray":
            raise ValueError("--shard and --executor ray do not combine: Ray splits the work itself")
        if self.heavy_atoms is not None:
            parse_range(self.heavy_atoms)
        if not 0 <= self.min_converged <= 1:
            raise ValueError(f"--min-converged is a share of conformers, in [0, 1]; got {self.min_converged}")
        if self.geometries is not None and (self.smiles is not None or self.relax == "mmff"):
            raise ValueError("--geometries labels the file's own geometries: it does not combine with "
                             f"{'--smiles' if self.smiles is not None else '--relax mmff'}")  # fmt: skip
        if self.trajectory and self.relax != "dft":
            raise ValueError("--trajectory stores the steps of --relax dft: add --relax dft")
        if self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")

    @property
    def source(self) -> ConformerSource:
        """Where the conformers come from: the geometry file, or RDKit embeddings of the SMILES."""
        if self.geometries is not None:
            return FileConformers(self.geometries)
        return EmbeddedConformers(self.smiles, self.conformers, self.seed, "mmff" if self.relax == "mmff" else None)

    @property
    def relaxes(self) -> bool:
        """Whether each conformer is relaxed at the run's own level before it is labelled (--relax dft)."""
        return self.relax == "dft"

    @property
    def stores_forces(self) -> bool:
        """--forces, or --relax dft, whose relaxed geometries come with their forces."""
        return self.forces or self.relaxes

    @property
    def layout(self) -> frozenset[str]:
        """The dataset's optional columns and groups (:func:`qm1b.store.layout.create_layout`)."""
        return frozenset((["forces"] if self.stores_forces else []) + (["optimizer_steps"] if self.relaxes else [])
                         + (["frames"] if self.trajectory else []))  # fmt: skip

    def resolved(self, dft: RKSConfig) -> Run:
        """These settings and the DFT settings ``dft`` resolved once (:class:`Run`)."""
        return Run(self, dft.for_forces() if self.stores_forces else dft, self.source, parse_shard(self.shard))


def provenance() -> dict[str, str]:
    """What the labels were computed with, beside their settings: the package versions, the device
    (a GPU's name, or the CPU's model) and the precision of every float32 product."""
    out = {"python": platform.python_version()}
    for name in ("pyscf-ipu", "jax", "jaxlib", "pyscf", "numpy", "rdkit", "h5py"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return {**out, "device": device_description(), "matmul_precision": MATMUL_PRECISION}


@dataclass(frozen=True)
class Run:
    """A generator run's settings, resolved once (:meth:`GenerateConfig.resolved`): every later stage
    reads these, none parses or rebuilds them again."""

    gen: GenerateConfig
    dft: RKSConfig  # as given, with the forces' float64 refinement made explicit (:meth:`RKSConfig.for_forces`)
    source: ConformerSource
    shard: tuple[int, int]  # (i, n): shard i of n

    @property
    def budget_gb(self) -> float:
        """--memory-budget, or the default share of the memory of the machine this runs on (each Ray
        task's own node)."""
        return self.gen.memory_budget or default_budget()

    def inputs(self) -> list[Input]:
        """The molecules of this shard, selected by --heavy-atoms and --limit."""
        heavy = parse_range(self.gen.heavy_atoms) if self.gen.heavy_atoms else None
        return self.source.inputs(heavy, self.gen.limit, self.shard)

    def buckets(self, method: Method, inputs: list[Input]) -> dict[int, object]:
        """Each input's size bucket by molecule id (None: RDKit cannot read it, or the basis lacks an element)."""
        return {entry.molecule_id: self.source.bucket(entry, method) for entry in inputs}

    def label_settings(self) -> dict:
        """Everything that defines the labels, as the dataset records it: a resumed run must use the
        same, and :func:`dft_config` reads the DFT settings back."""
        dft, gen = self.dft, self.gen
        own = {f.name: getattr(dft, f.name) for f in dataclasses.fields(dft)
               if f.name != "ipu" and f.name not in RKSConfig.PLACEMENT}  # fmt: skip
        return {
            **own,
            "refine_commutator": dft.refine_threshold,  # auto (none) and 0 are the same labels
            "jk_strategy": dft.ipu.jk_strategy,  # the simulated IPU's placement options never change a label
            "stop_threshold": dft.stop_threshold,
            **self.source.settings(),
            "drop_unconverged": gen.drop_unconverged,
            "forces": gen.stores_forces,
            "heavy_atoms": gen.heavy_atoms,
            # only where relaxed: the settings of datasets made without are unchanged
            **({"relax": "dft", "max_steps": gen.max_steps, "trajectory": gen.trajectory} if gen.relaxes else {}),
            **({"preset": gen.preset} if gen.preset is not None else {}),  # likewise, only where one was named
        }


def dft_config(settings: dict) -> RKSConfig:
    """The :class:`RKSConfig` a dataset was generated with, from its recorded settings (:meth:`Run.label_settings`)."""
    names = {f.name for f in dataclasses.fields(RKSConfig)} - {"ipu", *RKSConfig.PLACEMENT}
    ipu = {f.name for f in dataclasses.fields(IPUConfig)}
    return RKSConfig(**{k: v for k, v in settings.items() if k in names},
                     ipu=IPUConfig(**{k: v for k, v in settings.items() if k in ipu}))  # fmt: skip


__all__ = ["CONVERGENCE_WINDOW", "EXECUTORS", "GENERATOR_DFT_DEFAULTS", "GenerateConfig", "Run", "dft_config",
           "provenance"]
