"""The code's shape: rules a reviewer would otherwise check by hand, read from the source's syntax tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pyscf_ipu", "qm1b", "schnet")
MOST_PARAMETERS = 8
# the name -> object registries, each defined beside its strategies and read by pyscf_ipu.resolution.resolve only
# the J-K backends themselves: the only modules that may ask which backend a run uses
BACKENDS = ("pyscf_ipu/jk/", "pyscf_ipu/ipu/backend.py")
BACKEND_NAMES = {"ipu", "dense", "s8", "df"}
BACKEND_CLASSES = {"DenseJK", "S8JK", "IPUJK", "FittedJK", "ExactERIs"}
REGISTRIES = {"FUNCTIONALS": "pyscf_ipu/xc/functionals.py", "JK_BACKENDS": "pyscf_ipu/jk/__init__.py",
              "INTEGRAL_SOURCES": "pyscf_ipu/integral_sources.py", "DISPERSIONS": "pyscf_ipu/dispersion.py"}  # fmt: skip


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
    ``pyscf_ipu.resolution.resolve``; every other module takes the resolved ``Method``."""
    readers = {path for path, tree in _modules() for node in ast.walk(tree)
               if isinstance(node, ast.Name) and node.id == registry}  # fmt: skip
    assert readers == {REGISTRIES[registry], "pyscf_ipu/resolution.py"}


def _names_jk(node: ast.AST) -> bool:
    """Whether ``node`` names a backend: a name or attribute such as ``jk``, ``config.jk`` or
    ``args.jk_name``, or a backend's ``name`` (``method.backend.name``, ``type(backend).__name__``)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    if isinstance(node, ast.Attribute) and name in ("name", "__name__"):
        return "backend" in ast.unparse(node.value)
    return "jk" in name.split("_")


def _backend_names(node: ast.AST) -> bool:
    """Whether ``node`` is a J-K backend's name (or class name) as a string, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES | BACKEND_CLASSES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(_backend_names, node.elts))


def backend_branches(path: str, tree: ast.AST) -> list[str]:
    """Where ``tree`` asks which J-K backend a run uses, instead of asking the backend: the
    ``density_fitted`` flag, a comparison of a ``jk`` setting or a backend's ``name`` with a backend's
    name, a ``match`` on a ``jk`` setting, or an ``isinstance`` test against a backend class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "density_fitted":
            found.append(f"{path}:{node.lineno} density_fitted")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_names_jk, operands)) and any(map(_backend_names, operands)):
                found.append(f"{path}:{node.lineno} compares a jk setting with a backend's name")
        elif isinstance(node, ast.Match) and _names_jk(node.subject):
            found.append(f"{path}:{node.lineno} matches a jk setting")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            classes = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[-1])
                       if isinstance(n, (ast.Name, ast.Attribute))]  # fmt: skip
            if BACKEND_CLASSES.intersection(classes):
                found.append(f"{path}:{node.lineno} isinstance of a backend class")
    return found


def test_no_module_but_the_backends_asks_which_backend_a_run_uses():
    """Density fitting and the exact ERIs differ in preparation, memory, size buckets, finalisation,
    reference and gradient; the backend object answers each (``pyscf_ipu.jk``), so no other module
    branches on a backend's name or kind."""
    found = [hit for path, tree in _modules() if not path.startswith(BACKENDS) for hit in backend_branches(path, tree)]
    assert not found, found


def test_the_backend_check_finds_each_kind_of_branch():
    """The check above fails on a probe module that asks in each of the ways it knows (and not on
    the lines that ask the backend, or compare other names)."""
    probe = ast.parse(
        "def f(config, method, backend, fitted, strategy):\n"
        "    if config.density_fitted:\n"
        "        return 1\n"
        "    if config.jk == 'df' or method.config.jk in ('ipu', 's8'):\n"
        "        return 2\n"
        "    if isinstance(backend, FittedJK) or isinstance(backend, (fitted.FittedJK, int)):\n"
        "        return 3\n"
        "    if method.backend.name == 'df' or type(backend).__name__ == 'IPUJK':\n"
        "        return 4\n"
        "    match config.jk:\n"
        "        case 'df':\n"
        "            return 5\n"
        "    if strategy.name == 's8' or config.xc == 'hf':\n"
        "        return 6\n"
        "    return method.backend.cpu_batch\n")  # fmt: skip
    found = sorted(backend_branches("probe.py", probe))
    assert found == ["probe.py:10 matches a jk setting", "probe.py:2 density_fitted",
                     "probe.py:4 compares a jk setting with a backend's name",
                     "probe.py:4 compares a jk setting with a backend's name",
                     "probe.py:6 isinstance of a backend class", "probe.py:6 isinstance of a backend class",
                     "probe.py:8 compares a jk setting with a backend's name",
                     "probe.py:8 compares a jk setting with a backend's name"]


def _imports(path: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules that ``tree`` (the module at ``path``) imports anywhere: at the top, inside
    functions and under ``TYPE_CHECKING`` alike."""
    name = path[:-3].replace("/", ".").removesuffix(".__init__")
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found |= {c for c in [base, *(f"{base}.{a.name}" for a in node.names)] if c in modules}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
    return found - {name}


def import_cycles(sources: dict[str, ast.AST]) -> list[list[str]]:
    """The groups of modules that import one another in a loop (strongly connected components of the
    import graph of ``sources``, path -> syntax tree, with more than one member)."""
    names = {p[:-3].replace("/", ".").removesuffix(".__init__"): p for p in sources}
    graph = {n: _imports(p, sources[p], set(names)) for n, p in names.items()}
    order, low, stack, cycles = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def test_no_modules_import_each_other_in_a_loop():
    """Data flows one way: no module imports, at the top, in a function or for types only, one that
    imports it back (the resolved settings, pyscf_ipu.method, sit below the strategies, and their
    resolution by name, pyscf_ipu.resolution, above)."""
    assert import_cycles(dict(_modules())) == []


def test_the_cycle_check_finds_a_loop_through_a_type_only_import():
    probe = {"pkg/a.py": ast.parse("from .b import f"),
             "pkg/b.py": ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C"),
             "pkg/c.py": ast.parse("def g():\n    from pkg.a import h"), "pkg/d.py": ast.parse("from . import a")}
    assert import_cycles(probe) == [["pkg.a", "pkg.b", "pkg.c"]]
