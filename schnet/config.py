"""SchNet model configurations (frozen dataclasses), named as the QM1B paper and its baselines used them.

Distances are in Angstrom. The layer structure is SchNet's (Schuett et al., J. Chem. Phys. 148,
241722 (2018)) as torch_geometric implements it, so parameter counts match that baseline exactly:
``schnet-9m`` has 9,088,513 parameters and ``small`` 238,465 (see docs/benchmarking.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class SchNetConfig:
    features: int = 128  # atom feature width (hidden_channels)
    filters: int = 128  # continuous-filter width (num_filters)
    interactions: int = 3
    gaussians: int = 50  # radial basis functions, centres evenly spaced on [0, cutoff]
    cutoff: float = 5.0  # Angstrom; filters vanish smoothly (cosine cutoff) at this distance
    neighbours: int | None = 28  # k nearest neighbours within the cutoff; None: every atom within it
    max_z: int = 100  # atom types the embedding knows (atomic numbers below this)

    def __post_init__(self) -> None:
        for name in ("features", "filters", "interactions", "gaussians"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.cutoff <= 0:
            raise ValueError(f"cutoff must be positive, got {self.cutoff}")
        if self.neighbours is not None and self.neighbours < 1:
            raise ValueError(f"neighbours must be at least 1 (or None for a radius graph), got {self.neighbours}")

    def replace(self, **changes) -> SchNetConfig:
        return dataclasses.replace(self, **changes)


CONFIGS: dict[str, SchNetConfig] = {
    # The QM1B paper's baseline: 1024 features, 256 filters, 5 interactions, 200 Gaussians, k = 28.
    "schnet-9m": SchNetConfig(features=1024, filters=256, interactions=5, gaussians=200, cutoff=15.0, neighbours=28),
    # torch_geometric's small anchor (docs/benchmarking.md): 128/128/3/50, cutoff 5 Angstrom.
    "small": SchNetConfig(features=128, filters=128, interactions=3, gaussians=50, cutoff=5.0, neighbours=28),
    # For tests and quick CPU runs.
    "tiny": SchNetConfig(features=32, filters=32, interactions=2, gaussians=16, cutoff=5.0, neighbours=12),
}


def get_config(name: str) -> SchNetConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown SchNet config {name!r}: choose one of {', '.join(CONFIGS)}") from None
