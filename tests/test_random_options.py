"""Both command lines over random combinations of options and inputs, good and bad (hypothesis).

Every combination either passes every check a run makes before its first SCF (then the test stops
it there: the computation itself is tested elsewhere) or ends with one line on stderr, no
traceback, and a documented non-zero exit code (2 for bad input, the modules' docstrings). The
values mix valid settings with the mistakes users make: unknown names, out-of-range numbers,
contradictory flags, missing or garbled files, a memory budget nothing fits.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyscf_ipu import cli as pyscf_ipu_cli
from qm1b import cli as qm1b_cli

EXIT_BAD_INPUT = 2
EXAMPLES = 200  # per command line: milliseconds each (a run that passes its checks stops there)


class Reached(Exception):
    """Raised where a run would start its first SCF: every check before it passed."""


def _stop(*args, **kwargs):
    raise Reached


# option: values, valid and not (None: a flag without a value)
SETTINGS = {
    "--basis": ["sto-3g", "6-31g", "def2-svp", "6-31g(2df,p)", "def2-tzvp", "cc-pvqz", "no-such-basis"],
    "--xc": ["b3lyp", "PBE", "hf", "m06", "wb97x", "WB97X-D"],
    "--dispersion": ["none", "auto", "d3bj", "D3BJ", "chg", "d4"],
    "--jk": ["auto", "ipu", "dense", "s8", "df", "magic"],
    "--grid-level": ["0", "3", "-1", "10", "x"],
    "--precision": ["float32", "float64", "float16"],
    "--max-iterations": ["1", "20", "0"],
    "--integrals": ["libcint", "jax", "auto", "host", "gpu"],
    "--eri-threshold": ["0", "1e-10", "-1"],
    "--eri-expcutoff": ["30", "-5"],
    "--diis-space": ["1", "8", "two"],
    "--stop-commutator": ["1e-5", "0"],
    "--ipus": ["0", "1", "16"],
    "--tiles": ["0", "10"],
    "--ipu-memory-proportion": ["0", "0.5", "2"],
    "--jk-strategy": ["auto", "rows", "s8", "tiles"],
    "--memory-budget": ["0.001", "-1", "8"],
    "--bucket-step": ["auto", "4", "0", "x"],
}
RUN_OPTIONS = {
    **SETTINGS,
    "--charge": ["0", "1", "one"],
    "--spin": ["0", "2"],
    "--unit": ["angstrom", "bohr", "furlong"],
    "--forces": [None],
    "--fixed-grid": [None],
    "--json": [None],
    "--profile": ["PROFILE"],
}
RUN_MOLECULES = [["--mol", "water"], ["--mol", "h2"], ["--mol", "methane"], ["--mol", "unobtainium"],
                 ["--atoms", "H 0 0 0; H 0 0 0.74"], ["--atoms", "Xx 0 0 0"], ["--atoms", ""],
                 ["--atoms", "H 0 0 0; H 0 0 0.01"], ["--xyz", "MISSING"], ["--xyz", "GARBLED"], ["--xyz", "WATER"],
                 [], ["--mol", "water", "--atoms", "H 0 0 0; H 0 0 1"]]  # fmt: skip
GENERATE_OPTIONS = {
    **SETTINGS,
    "--conformers": ["1", "0", "-1"],
    "--seed": ["0", "1"],
    "--batch-size": ["auto", "1", "0", "eight"],
    "--limit": ["0", "1"],
    "--heavy-atoms": ["1-3", "x", "3-1", "1"],
    "--relax": ["mmff", "uff"],
    "--shard": ["0/1", "2/1", "a/b", "0/2"],
    "--resume": [None],
    "--drop-unconverged": [None],
    "--min-converged": ["0.5", "2", "-1"],
    "--forces": [None],
    "--executor": ["local", "mpi"],
    "--preset": ["qm1b", "ani1x", "qm9", "nabladft", "spice"],
    "--task-molecules": ["0", "4"],
    "--task-threads": ["0", "1"],
}
GENERATE_INPUTS = [["--smiles", "SMILES"], ["--smiles", "MISSING"], ["--smiles", "EMPTY"], ["--smiles", "GARBLED"],
                   ["--geometries", "WATER"], ["--geometries", "MISSING"], ["--geometries", "GARBLED"],
                   ["--smiles", "SMILES", "--geometries", "WATER"]]  # fmt: skip


def options(pool: dict) -> st.SearchStrategy[list[str]]:
    """A random subset of ``pool``'s options, each with one of its values, in a random order."""
    keys = st.lists(st.sampled_from(sorted(pool)), unique=True, max_size=6)
    return keys.flatmap(lambda names: st.tuples(*[st.sampled_from(pool[n]) for n in names]).map(
        lambda values, names=names: [part for n, v in zip(names, values) for part in ([n] if v is None else [n, v])]))


def _files(directory: Path) -> dict[str, str]:
    """The placeholders' files: a good XYZ, a good SMILES file, a garbled and an empty one."""
    files = {"WATER": "water.xyz", "GARBLED": "garbled.xyz", "SMILES": "one.smi", "EMPTY": "empty.smi"}
    (directory / files["WATER"]).write_text("3\nwater\nO 0 0 0.1173\nH 0 0.7572 -0.4692\nH 0 -0.7572 -0.4692\n")
    (directory / files["GARBLED"]).write_text("three\n\x00\x01 not a molecule\n")
    (directory / files["SMILES"]).write_text("CO methanol\n")
    (directory / files["EMPTY"]).write_text("")
    paths = {key: str(directory / name) for key, name in files.items()}
    return {**paths, "MISSING": str(directory / "missing.xyz"), "PROFILE": str(directory / "profile.json")}


def _run(main, argv: list[str]) -> tuple[int | None, str]:
    """(exit code, or None where the run reached its first SCF; stderr) of ``main(argv)``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except Reached:
            code = None
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
    return code, err.getvalue()


def _assert_one_line_or_reached(argv: list[str], code, err: str, prog: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    event("reached the SCF" if code is None else f"exit {code}")
    if code is None:  # a valid run, stopped at its first SCF
        assert all("Traceback" not in line for line in lines), (argv, err)
        return
    assert code == EXIT_BAD_INPUT, (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith(prog), (argv, err)


@pytest.fixture
def stopped_before_the_scf(monkeypatch):
    import pyscf_ipu.problem
    import qm1b.generate

    monkeypatch.setattr(pyscf_ipu.problem, "prepare_batch", _stop)  # pyscf-ipu run imports it when it runs
    monkeypatch.setattr(qm1b.generate, "provenance", _stop)  # the generator's first step after its checks


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(molecule=st.sampled_from(RUN_MOLECULES), chosen=options(RUN_OPTIONS))
def test_pyscf_ipu_run_never_shows_a_traceback(stopped_before_the_scf, molecule, chosen):
    with tempfile.TemporaryDirectory() as directory:
        files = _files(Path(directory))
        argv = ["run", *[files.get(part, part) for part in molecule + chosen]]
        code, err = _run(pyscf_ipu_cli.main, argv)
        _assert_one_line_or_reached(argv, code, err, "pyscf-ipu")


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(GENERATE_INPUTS), chosen=options(GENERATE_OPTIONS))
def test_qm1b_generate_never_shows_a_traceback(stopped_before_the_scf, source, chosen):
    with tempfile.TemporaryDirectory() as directory:
        files = _files(Path(directory))
        argv = ["generate", "--out", str(Path(directory) / "out"), "--no-progress",
                *[files.get(part, part) for part in source + chosen]]  # fmt: skip
        code, err = _run(qm1b_cli.main, argv)
        _assert_one_line_or_reached(argv, code, err, "qm1b")
