"""reuse_freed_memory: with its settings, a large array allocated again, by numpy or by a compiled
XLA program (also one that reads a host array copied just before it runs), reuses the pages of the
last one instead of faulting in fresh ones (the page-fault counts of a fresh process are the
independent measure); without them, every such array gets new pages. on_device returns finished
copies."""

import json
import platform
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from pyscf_ipu.programs import on_device

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# MB: above glibc's largest dynamic mmap threshold (32 MB); on a thread other than the main one,
# within the 64 MB its heap can hold
SIZES = {"numpy, main thread": 80, "numpy, another thread": 48, "XLA program output": 80,
         "XLA program output, from a host array": 80}
REPEATS = 12  # allocations of each kind, one after another, each freed before the next

PROBE = textwrap.dedent(f"""
    import json, resource, sys, threading
    import jax, jax.numpy as jnp
    import numpy as np
    from pyscf_ipu.runtime import disable_numpy_huge_pages, reuse_freed_memory
    from pyscf_ipu.programs import compiled
    if sys.argv[1] == "apply":
        assert reuse_freed_memory()
    disable_numpy_huge_pages()  # 4 KB pages: one fault per page written
    sizes = {SIZES!r}
    faults = {{}}

    def repeatedly(where, make):
        faults[where] = []
        for _ in range({REPEATS}):
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
    repeatedly("numpy, main thread", numpy_array)
    worker = threading.Thread(target=repeatedly, args=("numpy, another thread", numpy_array))
    worker.start()
    worker.join()
    repeatedly("XLA program output", lambda size: fill(np.float32(1)).block_until_ready())
    # a host array of half the output's size, which XLA copies on one of its threads
    doubled = compiled(lambda x: jnp.concatenate([x, x]) * 2, name="doubled")
    half = lambda size: np.full(size // 8, 1.0, np.float32)
    doubled(half(sizes["XLA program output, from a host array"] << 20)).block_until_ready()
    repeatedly("XLA program output, from a host array", lambda size: doubled(half(size)).block_until_ready())
    print(json.dumps({{"faults": faults, "asynchronous": jax.config.read("jax_cpu_enable_async_dispatch")}}))
""")


def pages(where: str) -> int:
    return (SIZES[where] << 20) // 4096


def probe(mode: str) -> dict:
    """{"faults": {kind: page faults of each allocation}, "asynchronous": XLA's CPU dispatch}"""
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_faults() -> dict[str, list[int]]:
    faults = probe("default")["faults"]
    if any(faults[w][1] < pages(w) // 2 for w in SIZES):  # e.g. transparent huge pages always on
        pytest.skip(f"this machine's default settings already reuse the pages ({faults})")
    return faults


@glibc_only
def test_by_default_every_large_array_faults_in_new_pages(default_faults):
    """The premise: without the settings, every array faults in (nearly) every page, every way."""
    for where in SIZES:
        assert all(f > 0.9 * pages(where) for f in default_faults[where]), default_faults


def fresh(faults: list[int], where: str) -> int:
    """How many allocations after the first got mostly new pages."""
    return sum(f > 0.5 * pages(where) for f in faults[1:])


@glibc_only
def test_apply_lets_later_arrays_reuse_the_pages_of_earlier_ones(default_faults):
    out = probe("apply")
    faults = out["faults"]
    for where in ("numpy, main thread", "numpy, another thread"):
        assert fresh(faults[where], where) == 0, (where, faults)
    # XLA frees an output's buffer a moment after its last reference goes, so now and then the
    # next run allocates before it is back (at most 3 of 11 in 10 trials); by default all 11 are new
    for where in ("XLA program output", "XLA program output, from a host array"):
        assert fresh(faults[where], where) < (REPEATS - 1) / 2, (where, faults)
    # XLA's own threads allocate from heaps of at most 64 MB: programs run on the calling thread
    assert out["asynchronous"] is False


def test_on_device_returns_once_the_host_arrays_are_copied():
    """XLA's CPU client copies a large host array on one of its threads: on_device waits for it, so
    that the program reading the copy runs on the calling thread (a plain device_put returns first)."""
    host = {"large": np.arange(8 << 20, dtype=np.float32), "small": np.arange(5)}
    out = on_device(host)
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(out))
    np.testing.assert_array_equal(np.asarray(out["large"]), host["large"])
    np.testing.assert_array_equal(np.asarray(out["small"]), host["small"])


def test_compiled_programs_take_their_host_arguments_through_on_device(monkeypatch):
    """A compiled program's numpy arguments are copied (and waited for) before it runs; its device
    arguments are passed on as they are."""
    from pyscf_ipu import programs

    copied = []

    def spy(tree, may_alias=None):
        copied.append(tree)
        return on_device(tree, may_alias)

    monkeypatch.setattr(programs, "on_device", spy)
    scaled = programs.compiled(lambda x, y: x * y, name="scaled_for_test")
    host, device = np.arange(4.0, dtype=np.float32), jax.numpy.full(4, 2.0, np.float32)
    np.testing.assert_array_equal(np.asarray(scaled(host, device)), 2 * host)
    assert len(copied) == 1 and any(leaf is host for leaf in copied[0])
    np.testing.assert_array_equal(np.asarray(scaled(device, device)), np.full(4, 4.0))
    assert len(copied) == 1  # device arguments only: nothing to copy
