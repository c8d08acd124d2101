"""The ``qm1b`` command line: generate, info, export, validate, plot.

    qm1b generate --smiles FILE --out DIR [--conformers K] [--seed S] [--batch-size B] [--resume]
                  [--shard i/n] [--executor local|ray] [DFT settings: --basis, --xc, ...]
    qm1b generate --geometries FILE.sdf|FILE.xyz|DIR --out DIR ...
    qm1b warm [generate's options] [--pack FILE]    build the run's programs ahead (and pack them)
    qm1b warm --unpack FILE                          install packed programs built on a machine like this
    qm1b info DIR
    qm1b export DIR --parquet FILE
    qm1b validate DIR --sample K [--tolerance MEV]
    qm1b plot DIR [--png FILE]

Bad input (unreadable SMILES file, an existing output without --resume, other settings on resume, a
directory with no dataset, a truncated or corrupt shard file) prints one line naming the problem and
exits with code 2; so does a ``generate`` run none of whose inputs gave a labelled conformer, each
failing for its own reason (its failures are recorded in the dataset). An output directory that
cannot be written (full disk, read-only, permissions) prints one line naming it and the cause and
exits with code 3; for ``generate``, what was committed stays, and ``--resume`` completes the run. A
run whose recent conformers mostly fail to converge (``--min-converged``) stops with one line saying
what to check and exits with code 4; what was committed stays. A lost Ray node (``--executor ray``)
is one line naming what died, with the ``--resume`` advice, and exit code 5. ``validate`` exits with
code 6, with one line naming the worst, when a converged record sampled has a label further from
PySCF than ``--tolerance`` (or none converged). A closed pipe (``qm1b info DIR | head``) ends
quietly with 141.
Without the generator's dependencies (``pip install 'pyscf-ipu[generator]'``), one line says so (code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from pyscf_ipu.cli import EXIT_BAD_INPUT, Parser, closed_pipe, reports_missing_extras
from pyscf_ipu.config import ConfigError, RKSConfig, add_config_arguments, config_from_arguments
from pyscf_ipu.runtime import reuse_freed_memory


EXIT_STORAGE = 3  # the output directory cannot be written
EXIT_NOT_CONVERGING = 4  # most recent conformers did not converge: a broken setup
EXIT_CLUSTER_LOST = 5  # the Ray cluster lost a process the run needs (--executor ray)
EXIT_LABELS_OFF = 6  # qm1b validate: a sampled label is further from PySCF than --tolerance
RESUME = "; what was committed is kept: run again with --resume once that is fixed"


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``preset`` (a name of :data:`~qm1b.presets.PRESETS`) makes its DFT settings the
    defaults of ``generate``'s and ``warm``'s options."""
    from .presets import preset_settings
    from .settings import GENERATOR_DFT_DEFAULTS, GenerateConfig
    from .validate import TOLERANCE_MEV

    parser = Parser(prog="qm1b", description="QM1B-style DFT dataset generator")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="SMILES -> conformers -> DFT labels -> HDF5 shards")
    add_config_arguments(gen.add_argument_group("generation"), GenerateConfig)
    defaults = {**GENERATOR_DFT_DEFAULTS, **preset_settings(preset)}
    add_config_arguments(gen.add_argument_group("DFT settings"), RKSConfig, defaults)
    warm = commands.add_parser("warm", help="build the programs a generate run with the same options will need, "
                               "before it starts; or install them from an archive")  # fmt: skip
    shipping = warm.add_argument_group("shipping").add_mutually_exclusive_group()
    shipping.add_argument("--pack", metavar="FILE", help="also write the programs to FILE (a .tar.gz with a manifest "
                          "of what they were built for), to install on machines like this one with --unpack")  # fmt: skip
    shipping.add_argument("--unpack", metavar="FILE", help="install the programs of FILE into this machine's cache "
                          "($PYSCF_IPU_CACHE), if it was built for this package, jax and device; builds nothing")  # fmt: skip
    add_config_arguments(warm.add_argument_group("generation"), GenerateConfig)
    add_config_arguments(warm.add_argument_group("DFT settings"), RKSConfig, defaults)
    info = commands.add_parser("info", help="counts, failures, convergence, throughput, label statistics")
    info.add_argument("directory")
    info.add_argument("--json", action="store_true")
    export = commands.add_parser("export", help="one Parquet file with the QM1B columns, or extended XYZ for "
                                 "ASE and machine-learned potentials")  # fmt: skip
    export.add_argument("directory")
    form = export.add_mutually_exclusive_group(required=True)
    form.add_argument("--parquet", metavar="FILE")
    form.add_argument("--extxyz", metavar="FILE", help="extended XYZ: positions in Angstrom, energy in eV and (where "
                      "the dataset has them) forces in eV/Angstrom, as ASE, MACE and NequIP read them")  # fmt: skip
    export.add_argument("--frames", action="store_true",
                        help="with --extxyz: the relaxations' trajectory frames (generate --relax dft --trajectory) "
                             "instead of the records")  # fmt: skip
    val = commands.add_parser("validate", help="recompute a random sample with PySCF float64")
    val.add_argument("directory")
    val.add_argument("--sample", type=int, default=10, metavar="K")
    val.add_argument("--seed", type=int, default=0)
    val.add_argument("--tolerance", type=float, default=TOLERANCE_MEV, metavar="MEV",
                     help=f"exit {EXIT_LABELS_OFF} if a converged record's label is further than this from PySCF "
                          f"(default {TOLERANCE_MEV:g} meV)")  # fmt: skip
    val.add_argument("--json", action="store_true")
    plot = commands.add_parser("plot", help="PNG: gap and energy-per-atom histograms, convergence rate")
    plot.add_argument("directory")
    plot.add_argument("--png", metavar="FILE", help="default: DIR/dataset.png")
    return parser


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed; where it names a ``--preset``, parsed again with the preset's settings as the
    DFT options' defaults, so that an option given beside it wins."""
    args = build_parser().parse_args(argv)
    if getattr(args, "preset", None) is not None:
        args = build_parser(args.preset).parse_args(argv)
    return args


def _run_settings(args):
    """(GenerateConfig, RKSConfig) of ``generate``'s and ``warm``'s arguments, their names and
    combinations (e.g. screening with density fitting) checked before any input is read; sets up the
    process first, before JAX runs anything (:func:`~pyscf_ipu.runtime.reuse_freed_memory`)."""
    reuse_freed_memory()
    from pyscf_ipu.resolution import resolve

    from .settings import GenerateConfig

    try:
        gen = config_from_arguments(args, GenerateConfig)
        dft = config_from_arguments(args, RKSConfig)
        resolve(dft)  # its names and combinations checked before any input is read
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return gen, dft


def _generate(args) -> int:
    from .generate import generate

    gen, dft = _run_settings(args)
    summary = generate(gen, dft)
    print("\n".join(summary.lines()))
    if gen.report:  # a list of one summary, as the report has always been written
        Path(gen.report).write_text(json.dumps([summary.to_dict()], indent=1))
    if summary.failures and not summary.conformers and not summary.skipped:  # each input failed for its own reason
        print(f"qm1b generate: error: no input gave a labelled conformer ({summary.failures} failures, recorded in "
              f"{gen.out}: qm1b info {gen.out})", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    return 0


def _warm(args) -> int:
    """Build a run's programs ahead (qm1b.warm), pack them, or install packed ones; a file or cache that
    cannot be written is a :class:`~qm1b.store.StorageError` (one line, exit 3)."""
    from .store import StorageError

    try:
        return _warm_or_unpack(args)
    except OSError as err:
        if isinstance(err, (StorageError, FileNotFoundError)) or err.filename is None:
            raise
        raise StorageError(f"cannot write {err.filename}: {err.strerror}") from None


def _warm_or_unpack(args) -> int:
    if args.unpack is not None:
        from pyscf_ipu.program_archive import unpack
        from pyscf_ipu.runtime import default_cache_dir

        installed = unpack(Path(args.unpack), default_cache_dir())
        print(f"{args.unpack}: {installed.added} program files installed in {default_cache_dir()}, "
              f"{installed.present} already there ({installed.manifest.get('method', 'programs')}; "
              f"built {installed.manifest.get('created', '?')})")  # fmt: skip
        return 0
    from .warm import warm, warm_and_pack

    gen, dft = _run_settings(args)
    run = gen.resolved(dft)
    if args.pack is None:
        print("\n".join(warm(run, progress=gen.progress).lines()))
        return 0
    warmed, packed = warm_and_pack(run, Path(args.pack), progress=gen.progress)
    print("\n".join(warmed.lines()))
    print(f"{packed.path}: {packed.files} program files, {packed.bytes / 1e6:.1f} MB")
    return 0


def _info(args) -> int:
    from .store import info

    stats = info(args.directory)
    if args.json:
        print(json.dumps(stats, indent=1, default=str))
        return 0
    for key, value in stats.items():
        if key in ("settings", "versions"):  # one line each: they are for the record, not for reading
            print(f"{key:24s} {json.dumps(value, sort_keys=True)}")
        elif isinstance(value, dict) and value:
            print(key)
            for sub, item in value.items():
                print(f"  {sub:22s} {_format(item)}")
        else:
            print(f"{key:24s} {_format(value)}")
    return 0


def _format(value) -> str:
    """Numbers to 4 significant digits (dicts of them inline), everything else as it is."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_format(v)}" for k, v in value.items())
    return str(value)


def _export(args) -> int:
    from .store import export_extxyz, export_parquet

    if args.frames and not args.extxyz:
        raise ValueError("--frames describes the --extxyz export")
    print(export_parquet(args.directory, args.parquet) if args.parquet else
          export_extxyz(args.directory, args.extxyz, frames=args.frames))  # fmt: skip
    return 0


def _validate(args) -> int:
    from .validate import QUANTITIES, validate

    report = validate(args.directory, args.sample, args.seed, args.tolerance)
    tolerance, outside, converged = report["tolerance_mev"], report["outside"], report["converged"]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{report['sampled']} records recomputed with PySCF float64 ({converged} converged); "
              f"{converged - len(outside)} of the converged within {tolerance:g} meV on every label")  # fmt: skip
        for q in QUANTITIES:
            s = report["abs_error_mev"][q]
            print(f"  |error| {q:6s} max {s['max']:.4f}  mean {s['mean']:.4f}  p95 {s['p95']:.4f} meV")
    if not converged:
        print(f"qm1b validate: none of the {report['sampled']} records sampled converged", file=sys.stderr)
        return EXIT_LABELS_OFF
    if outside:
        worst = max(outside, key=lambda r: max(abs(v) for v in r["errors_mev"].values()))
        label, error = max(worst["errors_mev"].items(), key=lambda item: abs(item[1]))
        print(f"qm1b validate: {len(outside)} of the {converged} converged records sampled are more than "
              f"{tolerance:g} meV from PySCF float64 (largest: {label} {error:+.3f} meV, molecule "
              f"{worst['molecule_id']} conformer {worst['conformer_id']})", file=sys.stderr)  # fmt: skip
        return EXIT_LABELS_OFF
    return 0


def _plot(args) -> int:
    from .plots import plot_dataset

    print(plot_dataset(args.directory, args.png))
    return 0


@reports_missing_extras("qm1b")
def main(argv: list[str] | None = None) -> int:
    from pyscf_ipu.ipu.plan import TileMemoryError
    from pyscf_ipu.molecule import MoleculeError

    from .ray_executor import ClusterLostError
    from .watch import NotConvergingError
    from .inputs import InputError
    from .store import StorageError

    handlers = {"generate": _generate, "warm": _warm, "info": _info, "export": _export, "validate": _validate,
                "plot": _plot}
    try:
        args = parse_arguments(argv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return handlers[args.command](args)
    except BrokenPipeError:
        return closed_pipe()
    except StorageError as err:
        print(f"qm1b {args.command}: error: {err}{RESUME if args.command == 'generate' else ''}", file=sys.stderr)
        return EXIT_STORAGE
    except ClusterLostError as err:
        print(f"qm1b {args.command}: error: {err}{RESUME}", file=sys.stderr)
        return EXIT_CLUSTER_LOST
    except NotConvergingError as err:
        print(f"qm1b {args.command}: stopped: {err}", file=sys.stderr)
        return EXIT_NOT_CONVERGING
    except (InputError, ConfigError, MoleculeError, TileMemoryError, FileExistsError, FileNotFoundError,
            ValueError) as err:  # fmt: skip
        print(f"qm1b {args.command}: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
