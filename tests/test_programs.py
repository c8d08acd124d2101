"""Compiled programs (pyscf_ipu.programs): stored and loaded by a new process, their files data only
(pyscf_ipu.program_files), and a quick-compile program's options on a CPU."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pyscf_ipu import programs
from pyscf_ipu.packed import FittedFactor
from pyscf_ipu.program_files import MAGIC, ProgramFileError, describe_tree, program_bytes, read_program, tree_of
from pyscf_ipu.programs import compiled

METHANE = "C 0 0 0; H 0.63 0.63 0.63; H -0.63 -0.63 0.63; H -0.63 0.63 -0.63; H 0.63 -0.63 -0.63"
on_a_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the quick-compile options are XLA's CPU's")


def run_methane(cache: Path) -> tuple[float, int, int]:
    """(energy, programs traced, programs loaded) of the SCF loop and ERI kernels in a new process
    that labels a batch of two methanes with the JAX integrals, its compilation cache in ``cache``."""
    script = textwrap.dedent(f"""
        import json
        from pyscf_ipu.config import RKSConfig
        from pyscf_ipu.resolution import resolve
        from pyscf_ipu.runtime import enable_compilation_cache
        from pyscf_ipu.problem import prepare_batch
        from pyscf_ipu.molecule import from_atom_string
        from pyscf_ipu.rks import submit_batch
        from pyscf_ipu.scf import scf_program
        from pyscf_ipu.integrals.eri_kernels import quartet_program
        enable_compilation_cache({str(cache)!r})
        m = from_atom_string({METHANE!r})
        method = resolve(RKSConfig(integrals="jax"))
        r = submit_batch(prepare_batch([m, m], method), method).results()[0]
        print(json.dumps([r.energy, scf_program.traced + quartet_program.traced,
                          scf_program.loaded + quartet_program.loaded]))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    energy, traced, loaded = json.loads(run.stdout.strip().splitlines()[-1])
    return energy, traced, loaded


def test_a_new_process_loads_stored_programs_without_tracing(tmp_path):
    """The second process finds every program on disk: it traces none (``traced`` stays 0), and its
    labels equal the first's exactly (the same compiled code)."""
    energy, traced, loaded = run_methane(tmp_path / "jax")
    energy2, traced2, loaded2 = run_methane(tmp_path / "jax")
    assert (traced, loaded) == (2, 0) and (traced2, loaded2) == (0, 2)
    assert energy2 == energy and np.isfinite(energy)
    assert len(list((tmp_path / "jax-programs").glob("*.program"))) >= 2


class Planted:
    """A pickle that, when loaded, writes ``path``: what a file planted in a shared cache would do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "code ran")


def test_a_pickle_planted_under_a_programs_name_runs_nothing(tmp_path):
    """Every stored program replaced by a pickle that writes a file when loaded (as the control shows
    it does): the next process writes nothing, exports the programs anew (they trace again) and its
    labels equal the first process's exactly; the files are program files again."""
    energy, _, _ = run_methane(tmp_path / "jax")
    stored = sorted((tmp_path / "jax-programs").glob("*.program"))
    marker, control = tmp_path / "planted-code-ran", tmp_path / "control"
    for path in stored:
        path.write_bytes(pickle.dumps(Planted(marker)))
    pickle.loads(pickle.dumps(Planted(control)))
    assert control.exists()  # the planted pickle is live: loading it runs code
    energy2, traced2, loaded2 = run_methane(tmp_path / "jax")
    assert not marker.exists()
    assert (traced2, loaded2) == (2, 0) and energy2 == energy
    for path in stored:
        read_program(path.read_bytes())


def test_a_program_files_output_tree_round_trips_as_plain_json():
    """Builtin nodes, None and this package's dataclasses with static data describe as JSON and
    rebuild to the same tree; a type of another package is not stored."""
    factor = FittedFactor(np.ones(2), np.ones(3), 7)
    tree = jax.tree.structure({"a": (1, None, [2, factor]), "b": 4})
    description = describe_tree(tree)
    assert tree_of(json.loads(json.dumps(description))) == tree
    with pytest.raises(TypeError, match="not this package's"):
        describe_tree(jax.tree.structure(jax.tree_util.Partial(np.add, 1)))


@pytest.mark.parametrize("header", [
    {"out_tree": {"type": "os:system", "aux": None, "children": []}},  # a type outside this package
    {"out_tree": {"type": "pyscf_ipu.packed:FittedFactor", "aux": [{"x": 1}], "children": ["*", "*"]}},
    {"out_tree": {"type": "dict", "aux": None, "children": []}},
    {"out_tree": {"type": "dict", "aux": ["a", "b"], "children": ["*", "*", "*"]}},  # jaxlib would read past "b"
    {"out_tree": {"type": "tuple", "aux": [1], "children": ["*"]}},
    {"out_tree": {"type": "pyscf_ipu.programs:jax.tree_util.Partial", "aux": None, "children": []}},
    {"out_tree": {"type": "pyscf_ipu.packed:FittedFactor", "aux": [3], "children": ["*"]}},  # one leaf short
    {"out_tree": ["*"]},
    {},
])  # fmt: skip
def test_a_program_file_with_a_header_it_would_not_write_is_refused(header):
    """A node type outside this package (never imported or called), or reached through one of its
    modules' attributes; static data that is not plain; a node that does not rebuild with its
    children; a malformed node; no output tree: refused before the module is read."""
    body = json.dumps(header).encode()
    with pytest.raises(ProgramFileError):
        read_program(MAGIC + len(body).to_bytes(8, "little") + body)


@pytest.mark.parametrize("body", [b"[" * 100_000, b"1" * 5000, b"\xff\xfe"])
def test_a_program_file_whose_header_breaks_the_parser_is_refused(body):
    """Nesting past the recursion limit, a number past Python's digit limit, bytes that are not UTF-8."""
    with pytest.raises(ProgramFileError):
        read_program(MAGIC + len(body).to_bytes(8, "little") + body)


def test_a_fifo_planted_under_a_programs_name_is_exported_over(monkeypatch, tmp_path):
    """A FIFO at a stored program's path would block a reader forever: it is not read, the program is
    exported anew and runs."""
    monkeypatch.setattr(programs, "program_directory", lambda: tmp_path)
    x = np.ones((4, 4), np.float32)
    first = compiled(kernel, name="fifo_probe")
    first(x)
    (stored,) = tmp_path.glob("fifo_probe-*.program")
    stored.unlink()
    os.mkfifo(stored)
    again = compiled(kernel, name="fifo_probe")
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))
    assert (again.loaded, again.traced) == (0, 1)


def test_a_program_file_that_is_not_one_is_refused():
    """A pickle, a truncated file and a file with a module that does not deserialize."""
    exported = jax.export.export(jax.jit(lambda x: [x + 1]))(np.ones(2, np.float32))
    good = program_bytes(exported.serialize(), jax.tree.structure([0]))
    read_program(good)
    for bad in (pickle.dumps((b"blob", None)), good[:20], good[: len(good) - 100]):
        with pytest.raises(ProgramFileError):
            read_program(bad)


def kernel(x):
    return jnp.exp(-x * x) @ x + jnp.log1p(x * x)


@on_a_cpu
def test_a_quick_compile_program_gives_the_plain_programs_values():
    """``quick_compile`` compiles with :data:`QUICK_COMPILE_CPU_OPTIONS`, which this jaxlib must know
    (XLA refuses an unknown option, so a jaxlib that dropped it fails here, not in a user's run), and
    the program's values are the default compile's within 2e-7 relative, 1e-6 absolute (a float32
    rounding or two: the two emitters' exp and log1p may round differently; measured 0)."""
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    quick = compiled(kernel, name="quick_probe", quick_compile=True)(x)
    plain = compiled(kernel, name="plain_probe")(x)
    np.testing.assert_allclose(np.asarray(quick), np.asarray(plain), rtol=2e-7, atol=1e-6)


@on_a_cpu
def test_the_quick_compile_options_reach_the_compiler_for_exported_and_loaded_programs(monkeypatch, tmp_path):
    """The options are passed to XLA, not dropped on the way, whether the program was just exported or
    read from the program directory by a later process (a new function of the same name): an option
    XLA does not know fails the compile of a quick-compile program either way, and leaves a plain
    one alone."""
    monkeypatch.setattr(programs, "program_directory", lambda: tmp_path)
    x = np.ones((4, 4), np.float32)
    compiled(kernel, name="quick_probe_stored", quick_compile=True)(x)  # exported, stored
    monkeypatch.setattr(programs, "QUICK_COMPILE_CPU_OPTIONS", {"xla_cpu_no_such_option": True})
    compiled(kernel, name="plain_probe_unknown")(x)
    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        compiled(kernel, name="quick_probe_unknown", quick_compile=True)(x)
    loaded = compiled(kernel, name="quick_probe_stored", quick_compile=True)
    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        loaded(x)
    assert (loaded.loaded, loaded.traced) == (1, 0)


def test_a_read_only_cache_directory_still_runs(tmp_path):
    """A cache directory this process cannot write (a shared cache mounted read-only): the process
    loads the programs stored there, stores none, and its labels equal those of the process that
    stored them; with the cache read-only and empty it traces everything and runs as well."""
    cache = tmp_path / "cache"
    cache.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(cache)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        energy, traced, _ = run_methane(cache / "jax")
        assert traced == 2
        stored = sorted(p.name for p in cache.rglob("*") if p.is_file())
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        energy2, traced2, loaded2 = run_methane(cache / "jax")
        assert (traced2, loaded2) == (0, 2) and energy2 == energy
        assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == stored
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(empty)], capture_output=True)
    assert mounted.returncode == 0, mounted.stderr
    try:
        energy3, traced3, loaded3 = run_methane(empty / "jax")
        assert (traced3, loaded3) == (2, 0) and energy3 == energy
    finally:
        subprocess.run(["umount", "-l", str(empty)], check=True)
