"""MemoryReuse: with its settings, a large array allocated again, by numpy or by a compiled XLA
program, reuses the pages of the last one instead of faulting in fresh ones (the page-fault counts
of a fresh process are the independent measure); without them, every such array gets new pages."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# MB: above glibc's largest dynamic mmap threshold (32 MB); on a thread other than the main one,
# within the 64 MB its heap can hold
SIZES = {"numpy, main thread": 80, "numpy, another thread": 48, "XLA program output": 80}

PROBE = textwrap.dedent(f"""
    import json, resource, sys, threading
    import jax, jax.numpy as jnp
    import numpy as np
    from pyscf_ipu.config import MemoryReuse, disable_numpy_huge_pages
    if sys.argv[1] == "apply":
        assert MemoryReuse().apply()
    disable_numpy_huge_pages()  # 4 KB pages: one fault per page written
    sizes = {SIZES!r}
    faults = {{}}

    def twice(where, make):
        faults[where] = []
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            array = make(sizes[where] << 20)
            del array
            faults[where].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    def numpy_array(size):
        array = np.empty(size, np.uint8)
        array.fill(1)
        return array

    fill = jax.jit(lambda x: jnp.full((sizes["XLA program output"] << 20) // 4, x))
    fill(np.float32(0)).block_until_ready()  # compiled before counting
    twice("numpy, main thread", numpy_array)
    worker = threading.Thread(target=twice, args=("numpy, another thread", numpy_array))
    worker.start()
    worker.join()
    twice("XLA program output", lambda size: fill(np.float32(1)).block_until_ready())
    print(json.dumps(faults))
""")


def pages(where: str) -> int:
    return (SIZES[where] << 20) // 4096


def probe(mode: str) -> dict[str, list[int]]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_faults() -> dict[str, list[int]]:
    faults = probe("default")
    if any(faults[w][1] < pages(w) // 2 for w in SIZES):  # e.g. transparent huge pages always on
        pytest.skip(f"this machine's default settings already reuse the pages ({faults})")
    return faults


def test_by_default_every_large_array_faults_in_new_pages(default_faults):
    """The premise: without the settings, both arrays fault in (nearly) every page, every way."""
    for where in SIZES:
        assert all(f > 0.9 * pages(where) for f in default_faults[where]), default_faults


def test_apply_lets_the_second_array_reuse_the_first_ones_pages(default_faults):
    faults = probe("apply")
    for where in SIZES:
        assert faults[where][1] < 0.05 * pages(where), (where, faults)  # a few stray pages at most
