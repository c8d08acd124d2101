"""Compiled programs' compiler options (pyscf_ipu.programs): a quick-compile program on a CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pyscf_ipu import programs
from pyscf_ipu.programs import compiled

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the quick-compile options are XLA's CPU's")


def kernel(x):
    return jnp.exp(-x * x) @ x + jnp.log1p(x * x)


def test_a_quick_compile_program_gives_the_plain_programs_values():
    """``quick_compile`` compiles with :data:`QUICK_COMPILE_CPU_OPTIONS`, which this jaxlib must know
    (XLA refuses an unknown option, so a jaxlib that dropped it fails here, not in a user's run), and
    the program's values are the default compile's: float32 within 2e-7 relative (the two emitters'
    exp and log1p may round differently; measured 0)."""
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)
    quick = compiled(kernel, name="quick_probe", quick_compile=True)(x)
    plain = compiled(kernel, name="plain_probe")(x)
    np.testing.assert_allclose(np.asarray(quick), np.asarray(plain), rtol=2e-7, atol=1e-6)


def test_the_quick_compile_options_reach_the_compiler(monkeypatch):
    """The options are passed to XLA, not dropped on the way: an option XLA does not know fails the
    compile of a quick-compile program, and leaves a plain one alone."""
    monkeypatch.setattr(programs, "QUICK_COMPILE_CPU_OPTIONS", {"xla_cpu_no_such_option": True})
    x = np.ones((4, 4), np.float32)
    compiled(kernel, name="plain_probe_unknown")(x)
    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        compiled(kernel, name="quick_probe_unknown", quick_compile=True)(x)
