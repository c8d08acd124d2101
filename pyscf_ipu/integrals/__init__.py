"""Gaussian integrals in JAX (on the device), for s, p, d and f shells.

- :mod:`.basis`: a PySCF ``Mole``'s basis as flat arrays of primitive Cartesian Gaussians;
- :mod:`.boys`: the Boys function F_0..F_m at once, gather-free;
- :mod:`.hermite`: the Hermite Gaussian algebra both integral kinds share (McMurchie-Davidson);
- :mod:`.one_electron`: overlap, kinetic and nuclear-attraction matrices;
- :mod:`.eri_plan`: which shell quartets the ERI kernels evaluate, in which chunks, written where;
- :mod:`.eri_kernels`: the ERI kernels, one per shell-quartet class, into PySCF's s8 layout;
- :mod:`.eri`: the ERI runner: a batch of conformers, its chunks shared out over worker threads;
- :mod:`.ao_values`: AO values and gradients on grid points.

Each takes atom positions either from the host (float64 differences, the most accurate float32
path) or as a JAX array, so that :mod:`pyscf_ipu.forces` can differentiate them.
"""
