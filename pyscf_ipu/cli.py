"""The ``pyscf-ipu`` command line; its ``run`` options are generated from :class:`RKSConfig`.

    pyscf-ipu run --mol benzene
    pyscf-ipu run --xyz molecule.xyz --xc b3lyp --basis 6-31g --json
    pyscf-ipu run --atoms "O 0 0 0; H 0 0.76 0.59" --check

Bad input (unknown element, odd electron count, unknown basis, ...) exits with code 2 and one line
that names the problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .config import (
    AUTO, COMMAND_LINE_DEFAULTS, MAX_STEPS, ConfigError, Criteria, RKSConfig, add_config_arguments, config_from_arguments,
)
from .runtime import disable_numpy_huge_pages, enable_compilation_cache, reuse_freed_memory
from .integrals.basis import UnsupportedBasisError
from .ipu.plan import TileMemoryError
from .geometries import parse_molecule
from .molecule import NAMED_MOLECULES, Molecule, MoleculeError
from .units import BOHR_PER_ANGSTROM, HARTREE_TO_EV, HARTREE_TO_MEV

if TYPE_CHECKING:  # the module itself is imported only where a run needs JAX
    from .method import Method

EXIT_BAD_INPUT = 2
EXIT_NOT_CONVERGED = 3
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


# Optional dependencies, by the extra that installs them (pyproject.toml).
EXTRAS = {"rdkit": "generator", "pyarrow": "generator", "h5py": "generator", "tqdm": "generator",
          "equinox": "schnet", "optax": "schnet", "ray": "ray"}  # fmt: skip


def reports_missing_extras(prog: str):
    """Decorator for a console entry point ``main(argv)``: an optional dependency that is not
    installed is one line naming the extra that installs it, and exit code 2."""

    def decorate(main):
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except ModuleNotFoundError as err:
                extra = EXTRAS.get((err.name or "").split(".")[0])
                if extra is None:
                    raise
                print(f"{prog}: error: {err.name} is not installed: pip install 'pyscf-ipu[{extra}]'", file=sys.stderr)
                return EXIT_BAD_INPUT

        return run

    return decorate


def closed_pipe() -> int:
    """The exit code after stdout's reader went away (``... | head``): stdout then points at
    /dev/null, so that the interpreter's last flush cannot fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_CLOSED_PIPE


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and a pointer to --help), not the whole usage."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pyscf-ipu", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one restricted Kohn-Sham single point")
    _molecule_and_settings(run)
    output = run.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    output.add_argument("--check", action="store_true", help="also run PySCF in float64 and print the differences")
    output.add_argument("--forces", action="store_true",
                        help="also compute the nuclear gradient dE/dR (Hartree/Bohr) of the energy as computed, exact or "
                             "density fitted (the grid moves with the atoms: the exact derivative of the energy); "
                             "the SCF then continues in float64 to max|FDS-SDF| < 5e-7 (--refine-commutator), which "
                             "puts them within about 3e-6 Hartree/Bohr of a float64 SCF's at 20 heavy atoms")
    output.add_argument("--fixed-grid", action="store_true",
                        help="with --forces: hold the grid fixed in space, as PySCF's default gradient does")  # fmt: skip
    output.add_argument("--profile", metavar="FILE.json",
                        help="profile the simulated IPU (--jk ipu): write its report and print its summary")
    output.add_argument("--profile-plot", metavar="FILE.png", help="profile the simulated IPU and draw its tile memory map")
    optimize = commands.add_parser("optimize", help="relax one molecule to a minimum of its energy (geomeTRIC's "
                                   "optimiser, forces with the grid's response)")  # fmt: skip
    _molecule_and_settings(optimize)
    steps = optimize.add_argument_group("optimiser")
    steps.add_argument("--max-steps", type=int, default=MAX_STEPS,
                       help=f"steps after the start before giving up (default: {MAX_STEPS}); it converges when "
                            f"{Criteria().describe()} (geomeTRIC's defaults)")  # fmt: skip
    steps.add_argument("--out", metavar="FILE.xyz", help="where the relaxed geometry goes (default: NAME_relaxed.xyz)")
    steps.add_argument("--trajectory", metavar="FILE.xyz",
                       help="also write every step as extended XYZ, with its energy (eV) and forces (eV/Angstrom)")
    return parser


def _molecule_and_settings(command: argparse.ArgumentParser) -> None:
    """The options that give a command its molecule and its DFT settings."""
    source = command.add_argument_group("molecule (give exactly one)")
    source.add_argument("--xyz", metavar="FILE", help="XYZ file, Angstrom")
    source.add_argument("--atoms", metavar="STR", help='atom string, e.g. "O 0 0 0; H 0 0.76 0.59"')
    source.add_argument("--mol", metavar="NAME", help=f"a named molecule: {', '.join(NAMED_MOLECULES)}")
    source.add_argument("--unit", default="angstrom", choices=("angstrom", "bohr"), help="unit of --atoms")
    source.add_argument("--charge", type=int, default=0, help="total charge (default: 0)")
    source.add_argument("--spin", type=int, default=0, help="2S; restricted Kohn-Sham needs 0")
    add_config_arguments(command.add_argument_group("settings"), RKSConfig, COMMAND_LINE_DEFAULTS)
    command.add_argument("--memory-budget", type=float, metavar="GB",
                         help="refuse a run whose estimated peak memory is above this (default: 80%% of this "
                              "machine's memory)")  # fmt: skip


def summary(molecule: Molecule, result, config: RKSConfig, chosen: bool = False) -> str:
    """The run's labels and timings as text; ``chosen``: the J-K backend came from ``--jk auto``."""
    name = molecule.name or molecule.formula
    dispersion = str(config.dispersion).strip().lower()
    lines = [
        f"{name}: {molecule.natom} atoms, {result.nao} AOs, {result.grid_points} grid points "
        f"(padded to {result.shapes[0]} AOs, {result.shapes[1]} points)",
        f"{config.xc}/{config.basis}, grid level {config.grid_level}, {config.precision}, J-K backend {config.jk}"
        + (f" (--jk auto, for {config.basis})" if chosen else "")
        + (f", dispersion {dispersion}" if dispersion != "none" else ""),
        f"energy   {result.energy:18.10f} Hartree",
        f"HOMO     {result.homo:18.10f} Hartree  {result.homo * HARTREE_TO_EV:10.4f} eV",
        f"LUMO     {result.lumo:18.10f} Hartree  {result.lumo * HARTREE_TO_EV:10.4f} eV",
        f"gap      {result.gap:18.10f} Hartree  {result.gap_ev:10.4f} eV",
        f"SCF      {'converged' if result.converged else 'NOT converged'} after {result.iterations} iterations "
        f"(energy std over the last 5: {result.energy_std_ev:.2e} eV, last change "
        f"{result.energy_change_history[-1]:+.1e} Hartree, max|FDS-SDF| {result.commutator_history[-1]:.1e})",
        f"grid     {result.electrons_on_grid:.6f} electrons integrated (exact: {molecule.nelectron})",
        "time     "
        + ", ".join(f"{k} {v:.3f}s" for k, v in result.timings.items())
        + f"; total {result.seconds:.2f}s",
    ]
    return "\n".join(lines)


def differences_mev(result, reference) -> dict[str, float]:
    """Our labels minus PySCF's (``--check``), in meV: energy, HOMO, LUMO and gap."""
    return {label: (getattr(result, label) - getattr(reference, label)) * HARTREE_TO_MEV
            for label in ("energy", "homo", "lumo", "gap")}  # fmt: skip


def check_lines(result, reference) -> list[str]:
    lines = [
        f"PySCF float64: energy {reference.energy:.10f} Hartree, {reference.cycles} cycles, "
        f"{'converged' if reference.converged else 'NOT converged'}, {reference.seconds:.2f}s "
        f"(ERIs {reference.eris}{'; added: ' + reference.added if reference.added else ''})"
    ]
    names = {"homo": "HOMO", "lumo": "LUMO"}
    lines += [f"  difference {names.get(k, k):6s} {v:+10.4f} meV" for k, v in differences_mev(result, reference).items()]
    return lines


def check_memory(molecule: Molecule, method: Method, budget_gb: float) -> None:
    """:class:`~pyscf_ipu.memory.MemoryBudgetError` if the run's estimated peak is above ``budget_gb``."""
    from .memory import check_memory as check_batch
    from .pyscf_mole import build_mole

    config = method.config
    build_mole(molecule, config.basis)  # an unknown basis or element is named first, as the run would
    check_batch(method.bucket(molecule), method, 1, budget_gb, f"{molecule.name or molecule.formula} at {config.basis}")


def run_command(args: argparse.Namespace) -> int:
    reuse_freed_memory()  # first: before JAX runs anything
    from .ipu.profile import plot_tile_map, summary_lines  # imported here: importing JAX takes a moment
    from .memory import default_budget
    from .resolution import resolve
    from .problem import prepare_batch
    from .rks import submit_batch

    molecule = parse_molecule(
        xyz=args.xyz, atoms=args.atoms, mol=args.mol, unit=args.unit, charge=args.charge, spin=args.spin
    )
    try:
        config = config_from_arguments(args, RKSConfig)
        if args.forces:
            config = config.for_forces()
        if args.memory_budget is not None and args.memory_budget <= 0:
            raise ValueError(f"--memory-budget is in GB and must be positive, got {args.memory_budget}")
        budget = args.memory_budget or default_budget()
        method = resolve(config, budget)
        if args.fixed_grid and not args.forces:
            raise ValueError("--fixed-grid describes the forces: add --forces")
        if (args.profile or args.profile_plot) and not method.backend.profiles:
            two = f" over two operators (--xc {config.xc})" if method.functional.range_separated else ""
            raise ValueError("--profile and --profile-plot describe the ipu backend's tiles for one operator; this "
                             f"run uses --jk {config.jk}{two}")
        check_memory(molecule, method, budget)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    enable_compilation_cache()
    disable_numpy_huge_pages()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        batch = prepare_batch([molecule], method)
        (result,) = submit_batch(batch, method, profile=bool(args.profile or args.profile_plot)).results()
        del batch  # the integrals and grid: the forces make their own
    result = dataclasses.replace(result, seconds=time.perf_counter() - start)  # the host preparation included
    gradient = None
    if args.forces:
        from .forces import nuclear_gradient

        start = time.perf_counter()
        gradient = nuclear_gradient(molecule, result, method, grid_response=not args.fixed_grid)
        forces_seconds = time.perf_counter() - start
    if result.jk_profile is not None:
        if args.profile:
            Path(args.profile).write_text(json.dumps(result.jk_profile, indent=1))
        if args.profile_plot:
            plot_tile_map(result.jk_profile, args.profile_plot)
    reference = None
    if args.check:
        from .reference import pyscf_reference

        reference = pyscf_reference(molecule, method)
    if args.json:
        out = result.to_dict()
        out["jk_profile"] = result.jk_profile
        out["jk_chosen"] = args.jk == AUTO  # the backend (config.jk) came from --jk auto
        out["molecule"] = {"name": molecule.name, "atoms": molecule.formula, "natom": molecule.natom}
        if gradient is not None:
            out["gradient_hartree_per_bohr"] = gradient.tolist()
            out["forces_seconds"] = forces_seconds
        if reference is not None:
            out["check_mev"] = differences_mev(result, reference)
            out["reference"] = {"energy_hartree": reference.energy, "cycles": reference.cycles}
        print(json.dumps(out, indent=1))
    else:
        print(summary(molecule, result, config, chosen=args.jk == AUTO))
        if result.jk_profile is not None:
            print("\n".join(summary_lines(result.jk_profile)))
        if reference is not None:
            print("\n".join(check_lines(result, reference)))
        if gradient is not None:
            print(f"gradient dE/dR (Hartree/Bohr), {forces_seconds:.2f}s:")
            for symbol, row in zip(molecule.symbols, gradient):
                print(f"  {symbol:2s} {row[0]:+12.6f} {row[1]:+12.6f} {row[2]:+12.6f}")
    return 0


def optimize_command(args: argparse.Namespace) -> int:
    """Relax one molecule, printing each step; the relaxed geometry as XYZ (exit 3 if it did not converge)."""
    reuse_freed_memory()
    from .memory import default_budget
    from .resolution import resolve
    from .optimize import relax

    molecule = parse_molecule(
        xyz=args.xyz, atoms=args.atoms, mol=args.mol, unit=args.unit, charge=args.charge, spin=args.spin
    )
    name = molecule.name or molecule.formula
    out = Path(args.out or f"{name}_relaxed.xyz")
    try:
        if args.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {args.max_steps}")
        if molecule.natom < 2:
            raise ValueError("a geometry optimisation needs at least two atoms")
        if args.memory_budget is not None and args.memory_budget <= 0:
            raise ValueError(f"--memory-budget is in GB and must be positive, got {args.memory_budget}")
        budget = args.memory_budget or default_budget()
        method = resolve(config_from_arguments(args, RKSConfig).for_forces(), budget)
        check_memory(molecule, method, budget)
        for path in [out] + ([Path(args.trajectory)] if args.trajectory else []):
            if not path.parent.is_dir():
                raise ValueError(f"cannot write {path}: no directory {str(path.parent)!r}")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    enable_compilation_cache()
    disable_numpy_huge_pages()
    frames: list[str] = []
    start = time.perf_counter()
    print(f"{name}: {molecule.natom} atoms, {method.config.xc}/{method.config.basis}, grid level "
          f"{method.config.grid_level}; gradient in Hartree/Bohr", flush=True)  # fmt: skip
    print(f"{'step':>4s} {'energy / Hartree':>18s} {'change':>10s} {'grad rms':>9s} {'grad max':>9s} {'seconds':>8s}")
    previous = [None]

    def on_step(_, frame) -> None:
        gradient = frame.gradient
        change = "" if previous[0] is None else f"{frame.energy - previous[0]:+10.2e}"
        previous[0] = frame.energy
        print(f"{frame.step:4d} {frame.energy:18.10f} {change:>10s} {np.sqrt(np.mean(gradient**2)):9.2e} "
              f"{np.abs(gradient).max():9.2e} {time.perf_counter() - start:8.2f}", flush=True)  # fmt: skip
        if args.trajectory:
            frames.append(frame_text(frame, name))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        (relaxation,) = relax([molecule], method, max_steps=args.max_steps, width=1, workers=0, on_step=on_step)
    final = relaxation.final
    if final is not None:
        write_text(out, frame_text(final, name))
    if args.trajectory:
        write_text(Path(args.trajectory), "".join(frames))
    if not relaxation.converged:
        print(f"pyscf-ipu: not converged: {relaxation.failure}"
              + (f"; the last geometry is in {out}" if final is not None else ""), file=sys.stderr)  # fmt: skip
        return EXIT_NOT_CONVERGED
    print(f"converged in {relaxation.steps} steps, {time.perf_counter() - start:.1f}s: energy "
          f"{final.energy:.10f} Hartree; relaxed geometry in {out}")  # fmt: skip
    return 0


def frame_text(frame, name: str) -> str:
    """One optimisation frame as extended XYZ (energy in eV, forces in eV/Angstrom)."""
    from .geometries import extxyz_frame

    molecule = frame.molecule
    return extxyz_frame(molecule.symbols, molecule.positions / BOHR_PER_ANGSTROM, energy_ev=frame.energy * HARTREE_TO_EV,
                        forces_ev_per_angstrom=-frame.gradient * HARTREE_TO_EV * BOHR_PER_ANGSTROM,
                        info={"name": name, "step": frame.step})  # fmt: skip


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {err.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "run":
            return run_command(args)
        if args.command == "optimize":
            return optimize_command(args)
    except (MoleculeError, ConfigError, TileMemoryError, UnsupportedBasisError) as err:
        print(f"pyscf-ipu: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return closed_pipe()
    parser.error(f"unknown command {args.command!r}")
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
