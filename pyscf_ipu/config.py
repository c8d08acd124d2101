"""Typed run configuration, and the command-line options generated from it.

Every setting a run depends on lives in one frozen dataclass, :class:`RKSConfig`. The CLI is built
from its fields (name, type, default, and the ``help``/``choices`` in each field's metadata), so a
new setting appears on the command line, in ``--help`` and in the recorded run config at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

PRECISIONS = ("float32", "float64")
AUTO = "auto"  # picked for the run: an integral source by the platform (resolution.resolve), a J-K backend by the basis
INTEGRALS = ("libcint", "jax", AUTO)
# Old spellings of renamed option values, still accepted (and read in stored settings) as the new ones.
RENAMED_VALUES: dict[str, dict[str, str]] = {"integrals": {"host": "libcint", "device": "jax"}}
# Settings added after datasets were first written, with the value that older datasets were made with.
ADDED_SETTINGS: dict[str, object] = {"refine_commutator": 0.0, "dispersion": "none"}
COMMAND_LINE_DEFAULTS = {"jk": AUTO}  # both command lines' defaults where they differ from RKSConfig's
# Basis-name prefixes (lower case, no dashes) of minimal bases: --jk auto keeps their ERIs exact.
MINIMAL_BASES = ("sto", "minao")
# The dispersion corrections that belong to a functional's definition (--dispersion auto); every other
# functional's is none.
OWN_DISPERSION = {"wb97x-d": "chg"}
# --eri-threshold auto's for float32 ERIs: each dropped value is below a float32 J or K element's rounding
FLOAT32_ERI_THRESHOLD = 1e-10
FORCES_REFINE_COMMUTATOR = 5e-7  # --refine-commutator auto with --forces (RKSConfig.for_forces)


class ConfigError(ValueError):
    """A bad setting; the message names it and the allowed values."""


MAX_STEPS = 100  # a geometry optimisation's steps after the start (PySCF's geomeTRIC driver's default)


@dataclass(frozen=True)
class Criteria:
    """When a conformer has converged: every one of these holds at once (geomeTRIC's default set,
    ``GAU``: Gaussian's, with an energy criterion added)."""

    energy: float = 1e-6  # Hartree, the last step's energy change
    grms: float = 3e-4  # Hartree/Bohr, root mean square of the gradient
    gmax: float = 4.5e-4  # Hartree/Bohr, largest gradient component
    drms: float = 1.2e-3  # Angstrom, root mean square of the last step
    dmax: float = 1.8e-3  # Angstrom, largest displacement of the last step

    def params(self) -> dict:
        return {f"convergence_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        return (f"energy change < {self.energy:g} Hartree, gradient rms < {self.grms:g} and max < {self.gmax:g} "
                f"Hartree/Bohr, step rms < {self.drms:g} and max < {self.dmax:g} Angstrom")  # fmt: skip


def option(default, help: str, choices=None, metavar=None, renamed: dict[str, str] | None = None, auto: bool = False):
    """A config field whose metadata becomes its command-line option (see :func:`add_config_arguments`);
    ``renamed`` maps old spellings of its values to the current ones; with ``auto``, the value
    ``auto`` on the command line stands for None (the run picks)."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar, "renamed": renamed,
                                            "auto": auto})  # fmt: skip


@dataclass(frozen=True)
class IPUConfig:
    """The simulated IPU that the ``ipu`` J-K backend plans its tiles for.

    The placement options (:data:`PLACEMENT`: model, IPUs, tiles, memory proportion) decide where
    the work goes and what the profile reports, never a label; the strategy decides how the float32
    sums are ordered, so it belongs to a run's label settings.
    """

    PLACEMENT: ClassVar[tuple[str, ...]] = ("ipu_model", "ipus", "tiles", "ipu_memory_proportion")

    jk_strategy: str = option("auto", "tile strategy of the ipu backend", choices=("auto", "rows", "s8"))
    ipu_model: str = option("bow", "simulated IPU model", choices=("bow", "mk2"))
    ipus: int = option(16, "simulated IPUs the ipu backend may spread over (a Bow Pod16); it uses the fewest that fit")
    tiles: int | None = option(None, "tiles per simulated IPU (default: the model's 1472)")
    ipu_memory_proportion: float = option(0.6, "share of each tile's memory the contraction may use")

    def __post_init__(self) -> None:
        if self.ipus < 1 or (self.tiles is not None and self.tiles < 1):
            raise ConfigError(f"--ipus and --tiles must be at least 1, got {self.ipus} and {self.tiles}")
        if not 0 < self.ipu_memory_proportion <= 1:
            raise ConfigError(f"the IPU memory proportion must be in (0, 1], got {self.ipu_memory_proportion}")


@dataclass(frozen=True)
class RKSConfig:
    """Settings of one restricted Kohn-Sham single point."""

    basis: str = option("sto-3g", "Gaussian basis set, any name PySCF knows with shells up to f (QM1B: sto-3g)")
    xc: str = option("b3lyp", "functional: b3lyp (PySCF's, VWN-RPA), b3lyp5 (VWN5), pbe, hf, wb97x (ωB97X) or wb97x-d "
                     "(ωB97X-D, with its own dispersion); the last two are range-separated: with --integrals jax "
                     "or auto")
    dispersion: str = option(AUTO, "empirical dispersion added to the energy and forces: none; d3bj (Grimme's D3 "
                             "with Becke-Johnson damping, two-body, with the functional's parameters); chg (Chai and "
                             "Head-Gordon's damped C6 term, ωB97X-D's own); or auto, the functional's own: chg for "
                             "wb97x-d, none for the others")
    grid_level: int = option(0, "PySCF Becke grid level, 0 (coarse, QM1B) to 9")
    precision: str = option("float32", "floating-point precision of the SCF loop", choices=PRECISIONS)
    jk: str = option("ipu", "J-K contraction backend: ipu (simulated IPU tiles), dense (reference), s8, df (density "
                     "fitting with PySCF's default fitting basis: no N^4 array; labels differ from exact ERIs by the "
                     "fitting error), or auto: ipu for a minimal basis (STO-nG, MINAO), df for any other")
    max_iterations: int = option(20, "maximum SCF iterations (QM1B: 20)")
    integrals: str = option(
        "libcint",
        "what computes the integrals, grid and guess: libcint (PySCF's, on the host, float64), jax (pyscf_ipu.integrals, "
        "assembled on the device for a whole batch, in float64) or auto (jax, with libcint's density-fitting factor "
        "where the device is this CPU); the old spellings host and device still work",
        choices=INTEGRALS,
        renamed=RENAMED_VALUES["integrals"],
    )
    eri_threshold: float | None = option(
        None,
        "Schwarz screening of the exact ERIs: drop (ij|kl) with sqrt((ij|ij)(kl|kl)) below this; 0 screens nothing; "
        "auto: 1e-10 where they are computed in float32 (far below what float32 resolves in J and K), else 0",
        auto=True,
    )
    eri_expcutoff: float = option(
        30.0,
        "libcint primitive screening of the ERIs (and of density fitting's 3-centre integrals): skip primitive "
        "products whose Gaussian prefactor bound is below exp(-this); 0 = libcint's default (60, nothing skipped "
        "in practice)",
    )
    diis_space: int = option(8, "number of Fock matrices kept for DIIS extrapolation")
    convergence_std_ev: float = option(
        0.01, "QM1B convergence: std of the energy over the last 5 iterations below this (eV)"
    )
    stop_commutator: float | None = option(
        None,
        "stop early once max|FDS-SDF| is below this; default 1e-5 (float32) or 1e-7 (float64); 0 never stops early",
    )
    refine_commutator: float | None = option(
        None,
        "continue the SCF in float64 after the loop until max|FDS-SDF| is below this (at most 12 DIIS iterations): "
        "forces need it, labels do not; auto: 5e-7 with --forces, else none (0)",
        auto=True,
    )
    bucket_step: int | None = option(
        None,
        "size buckets' step for kinds of atom with fewer than 4 AOs (hydrogen at STO-3G), in AOs' worth of atoms: "
        "a coarser step pads more and compiles fewer programs; never changes a label beyond float32 rounding; "
        "auto: 4 on a CPU, 16 on an accelerator",
        auto=True,
    )
    ipu: IPUConfig = field(default=IPUConfig(), metadata={"nested": True})

    # fields that decide where and how the work runs, never a label: a dataset does not record them
    PLACEMENT: ClassVar[tuple[str, ...]] = ("bucket_step",)

    def __post_init__(self) -> None:
        for name, renamed in _renamed_values(RKSConfig).items():  # an old spelling becomes the current one
            object.__setattr__(self, name, renamed.get(getattr(self, name), getattr(self, name)))
        if self.jk == AUTO:  # resolved here, so that every later stage and the recorded settings see the backend
            object.__setattr__(self, "jk", auto_jk(self.basis))
        if str(self.dispersion).strip().lower() == AUTO:  # resolved here: the recorded settings name the correction
            object.__setattr__(self, "dispersion", OWN_DISPERSION.get(str(self.xc).strip().lower(), "none"))
        if self.integrals not in INTEGRALS:
            raise ConfigError(f"integrals must be one of {', '.join(INTEGRALS)}, got {self.integrals!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.grid_level <= 9:
            raise ConfigError(f"grid level must be 0 to 9, got {self.grid_level}")
        if self.max_iterations < 1:
            raise ConfigError(f"max iterations must be at least 1, got {self.max_iterations}")
        if self.diis_space < 2:
            raise ConfigError(f"the DIIS space must hold at least 2 matrices, got {self.diis_space}")
        if self.eri_threshold is not None and self.eri_threshold < 0:
            raise ConfigError(f"the ERI threshold must be >= 0, got {self.eri_threshold}")
        if self.eri_expcutoff < 0:
            raise ConfigError(f"the ERI exponent cutoff must be >= 0, got {self.eri_expcutoff}")
        if self.bucket_step is not None and self.bucket_step < 1:
            raise ConfigError(f"--bucket-step is in AOs and must be at least 1, got {self.bucket_step}")
        if self.refine_commutator is not None and not 0 <= self.refine_commutator < 1:
            raise ConfigError(f"--refine-commutator must be in [0, 1), got {self.refine_commutator}")

    @property
    def stop_threshold(self) -> float:
        """The early-stopping threshold on max|FDS-SDF| (0 disables early stopping).

        Float32's 1e-5 keeps the labels an order of magnitude inside the 2 meV tolerance; a looser
        stop saves few iterations for a larger gap error (``docs/decisions/stop-threshold.md``).
        """
        if self.stop_commutator is not None:
            return self.stop_commutator
        return 1e-5 if self.precision == "float32" else 1e-7

    @property
    def refine_threshold(self) -> float:
        """The float64 refinement's threshold on max|FDS-SDF| (0: none); auto (None) is none."""
        return self.refine_commutator or 0.0

    def eri_screening(self, eri_dtype) -> float:
        """The Schwarz screening threshold of exact ERIs computed in ``eri_dtype``: ``eri_threshold``, or
        auto's, :data:`FLOAT32_ERI_THRESHOLD` for float32 ERIs and none (0) for float64 ones, whose
        labels it would move where float64 resolves them (``docs/decisions/eri-screening.md``)."""
        if self.eri_threshold is not None:
            return self.eri_threshold
        return FLOAT32_ERI_THRESHOLD if np.dtype(eri_dtype) == np.float32 else 0.0

    def for_forces(self) -> RKSConfig:
        """These settings with auto's refinement made explicit for nuclear gradients: those are first
        order in the orbitals' error where the labels are second order, and a float32 loop stops near
        its own rounding floor (``docs/decisions/fitted-forces.md``)."""
        return self if self.refine_commutator is not None else self.replace(refine_commutator=FORCES_REFINE_COMMUTATOR)

    def replace(self, **changes) -> RKSConfig:
        return dataclasses.replace(self, **changes)


def auto_jk(basis: str) -> str:
    """The J-K backend that ``--jk auto`` picks for ``basis``: the exact ERIs (``ipu``) for a minimal
    basis, whose ERI arrays are small and whose density-fitting error is large, and density fitting
    (``df``) for any other, where it is the faster and the exact arrays grow as N^4
    (``docs/decisions/jk-auto.md``). It depends on the basis alone, so that every shard and every
    molecule of a dataset gets the same method."""
    name = str(basis).strip().lower().replace("-", "").replace("_", "")
    return "ipu" if name.startswith(MINIMAL_BASES) else "df"


def _renamed_values(cls) -> dict[str, dict[str, str]]:
    """The fields of ``cls`` whose values were renamed, each with its old spellings (``option(renamed=)``)."""
    return {f.name: f.metadata["renamed"] for f in dataclasses.fields(cls) if f.metadata.get("renamed")}


def _base_type(tp):
    """``float | None`` -> float; plain types unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def add_config_arguments(parser: argparse.ArgumentParser, cls, defaults: dict | None = None) -> None:
    """Add one ``--option`` per field of the dataclass ``cls`` (``defaults`` overrides field defaults)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        if f.metadata.get("nested"):  # a config of its own, its options beside this one's
            add_config_arguments(parser, tp, defaults)
            continue
        flag = "--" + f.name.replace("_", "-")
        default = (defaults or {}).get(f.name, f.default)
        help_text = f.metadata.get("help", "")
        if default is not None:
            help_text += f" (default: {default})"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            renamed = f.metadata.get("renamed") or {}
            if f.metadata.get("auto"):
                renamed = {**renamed, "auto": None}
            parser.add_argument(
                flag,
                type=(lambda value, tp=tp, renamed=renamed: renamed[value] if value in renamed and renamed[value] is None
                      else tp(renamed.get(value, value))) if renamed else tp,
                default=default,
                choices=f.metadata.get("choices"),
                metavar=f.metadata.get("metavar"),
                help=help_text,
            )


def config_from_arguments(args: argparse.Namespace, cls):
    """Build ``cls`` from the parsed options that :func:`add_config_arguments` added."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: config_from_arguments(args, _base_type(hints[f.name])) if f.metadata.get("nested")
                  else getattr(args, f.name) for f in dataclasses.fields(cls)})  # fmt: skip
