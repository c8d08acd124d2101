"""The ``pyscf-ipu`` command: bad input exits 2 with a clear message; good input gives right numbers."""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyscf_ipu.cli import main
from pyscf_ipu.config import RKSConfig
from pyscf_ipu.molecule import from_name
from pyscf_ipu.units import HARTREE_TO_EV, HARTREE_TO_MEV
from .tolerances import LABEL_MEV

BAD_INPUT = [
    (["--atoms", "Xx 0 0 0"], "unknown element 'Xx'"),
    (["--atoms", "Xe 0 0 0", "--basis", "6-31g"], "Xe not in basis '6-31g'"),
    (["--atoms", "H 0 0 0; I 0 0 1.6", "--basis", "def2-svp"], "needs an effective core potential for I"),
    (["--atoms", "H 0 0 0"], "even electron count"),
    (["--mol", "water", "--charge", "1"], "even electron count"),
    (["--mol", "water", "--spin", "2"], "closed shell"),
    (["--atoms", "H 0 0 0; H 0 0 0.05"], "0.05 Angstrom apart"),
    (["--atoms", ""], "no atoms"),
    (["--atoms", "H 0 0 nan; H 0 0 0.7"], "NaN or infinite"),
    (["--mol", "water", "--basis", "no-such-basis"], "unknown basis"),
    (["--mol", "water", "--xc", "m06"], "unknown functional 'm06'"),
    (["--mol", "water", "--jk", "magic"], "unknown J-K backend 'magic'"),
    (["--mol", "water", "--grid-level", "10"], "grid level must be 0 to 9"),
    (["--mol", "water", "--precision", "float16"], "invalid choice"),
    (["--mol", "water", "--atoms", "H 0 0 0; H 0 0 1"], "exactly one"),
    (["--xyz", "/no/such/file.xyz"], "cannot read XYZ file"),
    (["--mol", "water", "--fixed-grid"], "--fixed-grid describes the forces"),
    (["--mol", "water", "--integrals", "gpu"], "invalid choice"),
    (["--mol", "water", "--basis", "cc-pvqz"], "g functions on O"),
    (["--mol", "water", "--dispersion", "d4"], "unknown dispersion 'd4'"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_exits_2_with_message(args, message, capsys):
    try:
        code = main(["run", *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3


def test_json_run_matches_the_api_and_pyscf(tmp_path, reference):
    """A real subprocess: the console entry point, JSON fields and their values."""
    xyz = tmp_path / "water.xyz"
    xyz.write_text("3\nwater\nO 0 0 0.1173\nH 0 0.7572 -0.4692\nH 0 -0.7572 -0.4692\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pyscf_ipu.cli", "run", "--xyz", str(xyz), "--json", "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ref = reference(from_name("water"), RKSConfig())
    assert abs(out["energy_hartree"] - ref.energy) * HARTREE_TO_MEV < LABEL_MEV
    assert out["gap_ev"] == pytest.approx(out["gap_hartree"] * HARTREE_TO_EV)
    assert out["gap_hartree"] == pytest.approx(out["lumo_hartree"] - out["homo_hartree"])
    assert out["nao"] == 7 and out["grid_points"] > 1000 and out["converged"] is True
    assert 5 <= out["iterations"] <= 20 and out["seconds"] > 0
    assert abs(out["check_mev"]["gap"]) < LABEL_MEV
    assert out["config"]["xc"] == "b3lyp" and out["config"]["precision"] == "float32"


def test_summary_gives_the_runs_numbers(capsys, reference):
    """The printed summary's numbers are the labels as computed: H2 (HF, float64) within 1e-6 Hartree
    of PySCF float64 in energy, HOMO, LUMO and gap, the gap also in eV, and the SCF converged."""
    assert main(["run", "--mol", "h2", "--precision", "float64", "--xc", "hf"]) == 0
    out = capsys.readouterr().out

    def hartree(label: str) -> float:
        return float(re.search(rf"^{label}\s+(\S+) Hartree", out, re.M).group(1))

    ref = reference(from_name("h2"), RKSConfig(xc="hf", precision="float64"))
    for label, expected in (("energy", ref.energy), ("HOMO", ref.homo), ("LUMO", ref.lumo), ("gap", ref.gap)):
        assert hartree(label) == pytest.approx(expected, abs=1e-6), label
    gap_ev = float(re.search(r"^gap\s+\S+ Hartree\s+(\S+) eV", out, re.M).group(1))
    assert gap_ev == pytest.approx(ref.gap * HARTREE_TO_EV, abs=1e-3)
    assert 1 <= int(re.search(r"^SCF\s+converged after (\d+) iterations", out, re.M).group(1)) <= 60


def test_forces_in_json_with_their_time(capsys):
    """``--forces --json`` adds the gradient and the seconds it took; H2's two atoms pull equally and
    oppositely along the bond: an STO-3G HF bond at 0.74 Angstrom is longer than its minimum
    (0.71), so the atom at z = 0 is pulled towards +z, dE/dz < 0."""
    assert main(["run", "--mol", "h2", "--xc", "hf", "--precision", "float64", "--forces", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    gradient = out["gradient_hartree_per_bohr"]
    assert len(gradient) == 2 and gradient[0] == pytest.approx([-g for g in gradient[1]], abs=1e-9)
    assert gradient[0][2] < -1e-3 and abs(gradient[0][0]) < 1e-9 and abs(gradient[0][1]) < 1e-9
    assert out["forces_seconds"] > 0
    assert out["config"]["refine_commutator"] == 5e-7  # --forces asks for converged orbitals


def test_the_dft_package_needs_no_generator_or_schnet_extras():
    """Every module of pyscf_ipu imports with the generator's, SchNet's and Ray's dependencies
    missing (blocked in ``sys.modules``), as after ``pip install pyscf-ipu`` without extras."""
    script = (
        "import sys, importlib, pkgutil\n"
        "for name in ('rdkit', 'pyarrow', 'tqdm', 'equinox', 'optax', 'ray'): sys.modules[name] = None\n"
        "import pyscf_ipu\n"
        "for module in pkgutil.walk_packages(pyscf_ipu.__path__, 'pyscf_ipu.'): importlib.import_module(module.name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("given, meant", [("host", "libcint"), ("device", "jax"), ("libcint", "libcint"), ("jax", "jax")])
def test_renamed_integral_sources_keep_their_old_spelling(given, meant):
    """``--integrals host|device`` (the names before libcint|jax) still parse, as the sources they
    meant, on both command lines; help names the current spellings only."""
    import argparse

    from pyscf_ipu.config import add_config_arguments, config_from_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RKSConfig)
    assert config_from_arguments(parser.parse_args(["--integrals", given]), RKSConfig).integrals == meant
    assert RKSConfig(integrals=given).integrals == meant
    assert "{libcint,jax,auto}" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--integrals", "gpu"])


def test_jk_auto_is_both_command_lines_default_and_resolves_by_the_basis():
    """Exact ERIs for minimal bases, density fitting for the rest; the settings hold the backend."""
    from pyscf_ipu.cli import build_parser
    from pyscf_ipu.config import config_from_arguments
    from qm1b.cli import build_parser as qm1b_parser

    for basis, expected in [("sto-3g", "ipu"), ("STO-6G", "ipu"), ("sto3g", "ipu"), ("minao", "ipu"),
                            ("6-31g*", "df"), ("def2-svp", "df"), ("cc-pvdz", "df")]:  # fmt: skip
        assert RKSConfig(jk="auto", basis=basis).jk == expected, basis
        for parser, argv in [(build_parser(), ["run", "--mol", "water"]), (qm1b_parser(), ["generate"])]:
            config = config_from_arguments(parser.parse_args([*argv, "--basis", basis]), RKSConfig)
            assert config.jk == expected, (argv, basis)
    assert RKSConfig(basis="def2-svp").jk == "ipu"  # the library's default stays the exact ERIs
    assert RKSConfig(jk="s8", basis="def2-svp").jk == "s8"  # a named backend is kept


def test_check_says_what_it_added_to_pyscfs_energy():
    """``--check``'s PySCF line names a correction this package added to PySCF's energy (ωB97X-D's)."""
    from types import SimpleNamespace

    from pyscf_ipu.cli import check_lines
    from pyscf_ipu.reference import Reference

    ours = SimpleNamespace(energy=-1.0, homo=-0.5, lumo=0.1, gap=0.6)
    added = Reference(-1.0, -0.5, 0.1, True, 8, 0.1, "density fitted, in memory", "chg dispersion -0.0001 Hartree")
    plain = Reference(-1.0, -0.5, 0.1, True, 8, 0.1, "density fitted, in memory")
    assert "added: chg dispersion -0.0001 Hartree" in check_lines(ours, added)[0]
    assert "added" not in check_lines(ours, plain)[0]
