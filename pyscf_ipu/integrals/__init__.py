"""Gaussian integrals in JAX (on the device), for s, p and d shells.

- :mod:`.basis`: a PySCF ``Mole``'s basis as flat arrays of primitive Cartesian Gaussians;
- :mod:`.boys`: the Boys function F_0..F_m at once, gather-free;
- :mod:`.one_electron`: overlap, kinetic and nuclear-attraction matrices by McMurchie-Davidson;
- :mod:`.eri`: the ERIs by McMurchie-Davidson, one kernel per shell-quartet class, in PySCF's s8 layout;
- :mod:`.ao_values`: AO values and gradients on grid points.

Each takes atom positions either from the host (float64 differences, the most accurate float32
path) or as a JAX array, so that :mod:`pyscf_ipu.forces` can differentiate them.
"""
