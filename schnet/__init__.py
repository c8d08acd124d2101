"""schnet: a JAX SchNet baseline for the HOMO-LUMO gap, trained on qm1b datasets or QM9.

    from schnet import CONFIGS, SchNet
    model = SchNet(CONFIGS["small"], key=jax.random.key(0))
"""

from .config import CONFIGS, SchNetConfig
from .model import SchNet

__all__ = ["CONFIGS", "SchNet", "SchNetConfig"]
