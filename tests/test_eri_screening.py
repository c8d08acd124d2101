"""Schwarz screening inside the device ERI kernels (``docs/decisions/eri-screening.md``): each quartet
class's rows sorted by their bounds, chunks below the threshold skipped, the destinations following
the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pyscf_ipu.config import FLOAT32_ERI_THRESHOLD, ConfigError, RKSConfig
from pyscf_ipu.integrals.eri import eri_s8
from pyscf_ipu.integrals.eri_plan import eri_capacity, plan_eri
from pyscf_ipu.pyscf_mole import build_mole
from pyscf_ipu.molecule import from_name
from pyscf_ipu.resolution import resolve


@pytest.mark.parametrize("omega", [0.0, 0.3])
def test_screening_leaves_out_only_values_below_the_threshold(omega):
    """Paracetamol (11 heavy atoms) at STO-3G under its size bucket's plan, in float64, Coulomb and
    long-range: at 1e-10 the kernels leave out more than a tenth of the non-zero values (measured
    0.18 and 0.19), every one of them below the threshold (Schwarz; measured at most 8.8e-11), and
    compute the rest as the unscreened kernels do, within float64 rounding (measured 1.7e-16: a
    chunk holds other rows)."""
    mol = build_mole(from_name("paracetamol"), "sto-3g")
    plan = plan_eri(mol, eri_capacity(mol), omega=omega)
    coords = mol.atom_coords()[None]
    with jax.enable_x64(True):
        full = np.asarray(eri_s8(plan, coords, jnp.float64, workers=2)[0])
        screened = np.asarray(eri_s8(plan, coords, jnp.float64, workers=2, threshold=1e-10)[0])
    dropped = (screened == 0) & (full != 0)
    print(f"omega {omega}: dropped {dropped.sum() / np.count_nonzero(full):.3f} of the non-zero values, "
          f"largest {np.abs(full[dropped]).max():.1e}; kept within {np.abs(screened - full)[~dropped].max():.1e}")
    assert dropped.sum() > 0.1 * np.count_nonzero(full)
    assert np.abs(full[dropped]).max() < 1e-10
    np.testing.assert_allclose(screened[~dropped], full[~dropped], rtol=0, atol=1e-14)


def test_auto_screens_float32_eris_alone():
    """``--eri-threshold auto`` screens float32 ERIs at 1e-10 and float64 ones not at all; a number
    holds for both; density fitting, which has no s8 ERIs, takes auto and refuses a number."""
    auto = RKSConfig()
    assert auto.eri_threshold is None
    assert auto.eri_screening(np.dtype(np.float32)) == FLOAT32_ERI_THRESHOLD == 1e-10
    assert auto.eri_screening(np.dtype(np.float64)) == 0.0
    for value in (0.0, 1e-8):
        given = RKSConfig(eri_threshold=value)
        assert given.eri_screening(np.dtype(np.float32)) == given.eri_screening(np.dtype(np.float64)) == value
    resolve(RKSConfig(jk="df"))
    with pytest.raises(ConfigError, match="never makes"):
        resolve(RKSConfig(jk="df", eri_threshold=1e-10))
    with pytest.raises(ConfigError, match=">= 0"):
        RKSConfig(eri_threshold=-1.0)
