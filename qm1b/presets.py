"""Presets: the levels of theory of known datasets, by name (``qm1b generate --preset NAME``).

A preset is a set of DFT settings (functional, basis, grid, dispersion and precision), nothing more:
it becomes the defaults of those options, so any option given beside it overrides it, and the
dataset records the preset's name beside the settings it resolved to. Each preset's dispersion is
``auto``, its functional's own (ωB97X-D's for ``nabladft``, none for the others), so that a
functional given beside a preset brings its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Preset:
    """A dataset's level of theory: ``settings`` are :class:`~pyscf_ipu.config.RKSConfig` fields."""

    name: str
    settings: MappingProxyType
    source: str  # the dataset's paper, and what it states about the level

    @classmethod
    def of(cls, name: str, source: str, **settings) -> Preset:
        return cls(name, MappingProxyType(settings), source)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset.of("qm1b", "QM1B (Mathiasen et al., NeurIPS 2023 Datasets and Benchmarks): B3LYP/STO-3G with PySCF 2.2, "
                  "whose b3lyp is VWN5's (b3lyp5 here), grid level 0, a float32 loop",
                  xc="b3lyp5", basis="sto-3g", grid_level=0, dispersion="auto", precision="float32"),
        Preset.of("qm9", "QM9 (Ramakrishnan et al., Sci. Data 1, 140022 (2014)): B3LYP/6-31G(2df,p) in Gaussian 09, "
                  "whose B3LYP is VWN-RPA's (b3lyp here)",
                  xc="b3lyp", basis="6-31g(2df,p)", grid_level=3, dispersion="auto", precision="float32"),
        Preset.of("ani1x", "ANI-1x (Smith et al., Sci. Data 7, 134 (2020)) and Transition1x (Schreiner et al., Sci. "
                  "Data 9, 779 (2022)): ωB97x/6-31G(d)",
                  xc="wb97x", basis="6-31g*", grid_level=3, dispersion="auto", precision="float32"),
        Preset.of("nabladft", "nablaDFT (Khrabrov et al., Phys. Chem. Chem. Phys. 24, 25853 (2022)) and ∇²DFT "
                  "(Khrabrov et al., NeurIPS 2024 Datasets and Benchmarks): ωB97X-D/def2-SVP in Psi4",
                  xc="wb97x-d", basis="def2-svp", grid_level=3, dispersion="auto", precision="float32"),
    )
}  # fmt: skip


def preset_settings(name: str | None) -> dict:
    """The DFT settings of preset ``name`` (none: {})."""
    return {} if name is None else dict(PRESETS[name].settings)


__all__ = ["PRESETS", "Preset", "preset_settings"]
