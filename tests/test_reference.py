"""The PySCF float64 reference behaves as it would in a process of its own."""

from __future__ import annotations

import pyscf.gto
import pyscf.lib
import pytest

from pyscf_ipu.config import RKSConfig
from pyscf_ipu.resolution import resolve
from pyscf_ipu.molecule import from_name
from pyscf_ipu.reference import pyscf_reference


@pytest.mark.parametrize("jk, held", [("ipu", "in memory"), ("df", "density fitted, in memory")])
def test_the_reference_keeps_its_integrals_in_memory_beside_a_large_process(monkeypatch, jk, held):
    """After our own SCF, the process still holds its peak memory (it is kept for reuse). PySCF
    compares that resident size with its ``max_memory`` and, above it, recomputes every integral in
    every cycle (direct SCF), or builds its density-fitted tensor on disk in small blocks: the
    ``--check`` timing line then showed the reference several times slower than alone. Here the
    process claims 20 GB resident, under PySCF's own default budget (not the suite's, see
    conftest.py); water's ERIs, or its fitted tensor, must still stay in memory."""
    held_mb = (20_000.0, 20_000.0)  # MB: (resident, peak), as pyscf.lib.current_memory reports them
    monkeypatch.setattr(pyscf.gto.Mole, "max_memory", pyscf.lib.param.MAX_MEMORY)
    monkeypatch.setattr(pyscf.lib, "current_memory", lambda: held_mb)
    ref = pyscf_reference(from_name("water"), resolve(RKSConfig(basis="6-31g", xc="b3lyp", jk=jk)))
    assert ref.converged
    assert ref.eris == held


def test_the_reference_cache_key_follows_pyscf_the_reference_code_and_the_method(monkeypatch):
    """A cached reference is used again only for the same geometry, settings, PySCF method, PySCF
    version and reference code: each of those changes the key, and an exact backend's name does not
    (every exact backend's reference is PySCF's same RKS)."""
    import inspect

    import pyscf

    from .conftest import _reference_code, reference_key

    water, config = from_name("water"), RKSConfig(basis="6-31g", xc="b3lyp")
    key = reference_key(water, config)
    assert reference_key(water, config.replace(jk="dense")) == key
    assert reference_key(water, config.replace(jk="df")) != key  # density fitted: DFRKS
    assert reference_key(water, config.replace(grid_level=1)) != key
    monkeypatch.setattr(pyscf, "__version__", "0.0-probe")
    assert reference_key(water, config) != key
    monkeypatch.undo()
    source = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: source(obj) + "# a changed line")
    _reference_code.cache_clear()  # the source is read once per process: read it again, changed
    assert reference_key(water, config) != key
    monkeypatch.undo()
    _reference_code.cache_clear()
