"""The code's shape: rules a reviewer would otherwise check by hand, read from the source's syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pyscf_ipu", "qm1b", "schnet")
MOST_PARAMETERS = 8
# the name -> object registries, each defined beside its strategies and read by pyscf_ipu.method.resolve only
REGISTRIES = {"FUNCTIONALS": "pyscf_ipu/xc/functionals.py", "JK_BACKENDS": "pyscf_ipu/jk.py",
              "INTEGRAL_SOURCES": "pyscf_ipu/integral_sources.py"}  # fmt: skip


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return count - (names[:1] in (["self"], ["cls"]))


def test_no_function_takes_more_than_eight_parameters():
    """Longer argument lists travel as records (pytrees such as ``AOTables``), not as loose arrays."""
    long = [f"{path}:{node.lineno} {getattr(node, 'name', 'lambda')} ({_parameters(node)})"
            for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            and _parameters(node) > MOST_PARAMETERS]  # fmt: skip
    assert not long, long


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_only_the_resolver_reads_a_registry(registry):
    """A functional, J-K backend or integral source is looked up by name in one place,
    ``pyscf_ipu.method.resolve``; every other module takes the resolved ``Method``."""
    readers = {path for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.Name) and node.id == registry}  # fmt: skip
    assert readers == {REGISTRIES[registry], "pyscf_ipu/method.py"}
