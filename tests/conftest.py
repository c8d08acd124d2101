"""Shared fixtures: the persistent compilation cache, test molecules and cached PySCF references.

PySCF float64 references are computed in the test run (tightly converged) and cached on disk,
keyed by the geometry, the settings, PySCF's version and the code that builds the reference
(:func:`reference_key`), so a second run does not repeat them and a change to either computes them
again.
Set PYSCF_IPU_CACHE to move the cache (default ~/.cache/pyscf-ipu).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import tempfile
import warnings

import numpy as np
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.runtime import default_cache_dir, enable_compilation_cache
from pyscf_ipu.prepare import PreparedProblem, prepare
from pyscf_ipu.molecule import Molecule
from pyscf_ipu.reference import Reference, pyscf_method, pyscf_reference, pyscf_runnable

from .molecules import QM9_NINE_HEAVY, molecule_by_name


def pytest_configure(config):
    enable_compilation_cache()
    warnings.filterwarnings("ignore", category=UserWarning, module="pyscf")
    pyscf_may_use_the_machines_memory()


#: Test files that compile many of the same programs, run by one worker one after the other (the
#: first file named): apart, each worker compiles them (test_optimize alone compiled 29 programs in
#: 167 s, after test_relax 15 in 95 s; benchmarks/RESULTS.md)
SHARED_PROGRAMS = {"tests/test_optimize.py": "tests/qm1b/test_relax.py"}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (``./test.sh``'s), with the files of :data:`SHARED_PROGRAMS` in one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedProgramsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_PROGRAMS.get(path, path)

    return SharedProgramsScheduling(config, log)


def pyscf_may_use_the_machines_memory() -> None:
    """Give every PySCF molecule made in this process (and the SCF and fitting objects that copy its
    ``max_memory``) the machine's physical memory as its budget instead of PySCF's 4000 MB.

    PySCF weighs that budget against the whole process's resident size. A test process holding a few
    GB of compiled programs would otherwise push the tests' own PySCF runs to direct SCF, or build
    a density-fitted tensor on disk in small blocks: a 9-heavy-atom reference at 6-31G* took 82 s
    beside 3.5 GB of ballast instead of 7 s. The tests' PySCF arrays are small beside the machine."""
    from pyscf import gto

    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gto.Mole.max_memory = max(gto.Mole.max_memory, pages // 2**20)  # MB


MAPPING_SHARE = 0.5  # of the kernel's memory-mapping limit per process, above which a test starts afresh


@pytest.fixture(autouse=True)
def within_the_memory_mapping_limit():
    """Each test starts with at most :data:`MAPPING_SHARE` of the process's memory-mapping limit in use
    (``vm.max_map_count``, 65,530 by default): every compiled program holds mappings for its machine
    code, and over a whole suite with an empty cache (hundreds of programs, a 6-31G* ERI program alone
    about 16,000) the process passed the limit and LLVM aborted it. Past the share, JAX's caches are
    cleared; a later test loads what it needs again from the persistent cache."""
    import jax

    from pyscf_ipu.programs import memory_mappings

    mappings = memory_mappings()
    if mappings is not None and mappings[0] > MAPPING_SHARE * mappings[1]:
        jax.clear_caches()
    yield


@pytest.fixture(scope="session")
def qm9_nine_heavy() -> dict[int, Molecule]:
    from pyscf_ipu.qm9 import qm9_molecules

    return {rec.index: rec.molecule for rec in qm9_molecules(QM9_NINE_HEAVY)}


@pytest.fixture(scope="session")
def host_of(qm9_nine_heavy):
    """host_of(name, basis, grid_level) -> PreparedProblem, the last few kept (level 3 ones are large)."""
    cache: dict[tuple, PreparedProblem] = {}

    def get(name: str, basis: str, grid_level: int) -> PreparedProblem:
        key = (name, basis, grid_level)
        if key not in cache:
            if len(cache) >= 8:
                cache.pop(next(iter(cache)))
            config = RKSConfig(basis=basis, grid_level=grid_level)
            cache[key] = prepare([molecule_by_name(name, qm9_nine_heavy)], resolve(config))[0]
        return cache[key]

    return get


@functools.lru_cache(maxsize=None)
def _reference_code(backends: tuple[type, ...], dispersion: type) -> str:
    """A hash of the source that builds PySCF's reference under a J-K backend of classes ``backends`` (a
    wrapper's, then the backend it wraps) and a dispersion correction of class ``dispersion`` (read once
    per pair and process, not on every lookup)."""
    import pyscf_ipu.pyscf_mole
    import pyscf_ipu.reference
    import pyscf_ipu.xc.functionals
    from pyscf_ipu.buckets import auxiliary_basis

    # the correction's whole module: a reference for a correction PySCF lacks holds this package's term
    sources = (pyscf_ipu.reference, *(b.pyscf_counterpart for b in backends), inspect.getmodule(dispersion),
               pyscf_ipu.pyscf_mole, pyscf_ipu.xc.functionals, auxiliary_basis)  # fmt: skip
    return hashlib.sha256("".join(inspect.getsource(source) for source in sources).encode()).hexdigest()


def reference_key(molecule: Molecule, config: RKSConfig) -> str:
    """The cache key of PySCF's reference for ``molecule`` under ``config``: the geometry, the settings
    PySCF sees, the PySCF method it runs (e.g. ``RKS`` or its density-fitted class), PySCF's version and
    the source of the code that builds the reference: ``pyscf_ipu.reference``, the J-K backend's
    ``pyscf_counterpart``, the molecule's PySCF form (``pyscf_ipu.pyscf_mole``), the functionals' libxc
    codes (``pyscf_ipu.xc.functionals``), the fitting basis (``buckets.auxiliary_basis``) and the
    dispersion correction's module."""
    import pyscf

    method = resolve(config)
    backend = method.backend  # a range-separated run's wraps the backend whose counterpart PySCF's run takes
    backends = (type(backend), *([type(backend.inner)] if hasattr(backend, "inner") else []))
    code = _reference_code(backends, type(method.dispersion))
    payload = {
        "z": molecule.atomic_numbers.tolist(),
        "pos": np.round(molecule.positions, 10).tolist(),
        "charge": molecule.charge,
        "basis": config.basis,
        "xc": config.xc,
        "dispersion": method.dispersion.name,
        "grid_level": config.grid_level,
        "pyscf_method": type(pyscf_method(molecule, pyscf_runnable(molecule, method)[0])).__name__,
        "pyscf": pyscf.__version__,
        "code": code,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


@pytest.fixture(scope="session")
def reference():
    """reference(molecule, config) -> tightly converged PySCF float64 Reference, cached on disk."""
    folder = default_cache_dir() / "references"
    folder.mkdir(parents=True, exist_ok=True)

    def get(molecule: Molecule, config: RKSConfig) -> Reference:
        path = folder / f"{reference_key(molecule, config)}.json"
        if path.exists():
            return Reference(**json.loads(path.read_text()))
        ref = pyscf_reference(molecule, resolve(config))
        assert ref.converged, f"PySCF did not converge for {molecule.name} {config}"
        # a temporary file of its own, then a rename: a killed run never leaves half a file, and two
        # test workers computing the same reference never write into one file
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as tmp:
            tmp.write(json.dumps(dataclasses.asdict(ref)))
        os.replace(tmp.name, path)
        return ref

    return get


@pytest.fixture
def drawn(monkeypatch):
    """The figures saved during a test, in order (every plot function saves through ``Figure.savefig``),
    so that a test can check what a picture shows, not just that a file was written."""
    from matplotlib.figure import Figure

    figures, save = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures
