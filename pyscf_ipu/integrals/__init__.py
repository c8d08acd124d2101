"""Gaussian integrals in JAX (on the device): the start of the on-device integral path.

- :mod:`.basis`: a PySCF ``Mole``'s basis as flat arrays of primitive Cartesian Gaussians;
- :mod:`.boys`: the Boys function F_m(T);
- :mod:`.one_electron`: overlap, kinetic and nuclear-attraction matrices by McMurchie-Davidson;
- :mod:`.ao_values`: AO values and gradients on grid points.

The ERIs, their tile distribution and the forces build on these (not yet here).
"""
