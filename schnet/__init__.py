"""schnet: a JAX SchNet baseline for the HOMO-LUMO gap, trained on qm1b datasets or QM9.

    from schnet import CONFIGS, SchNet
    model = SchNet(CONFIGS["small"], key=jax.random.key(0))

The model needs the ``schnet`` extra (equinox, optax); it is imported on first use, so that the
command line can say so when it is missing.
"""

from .config import CONFIGS, SchNetConfig

__all__ = ["CONFIGS", "SchNet", "SchNetConfig"]


def __getattr__(name: str):
    if name == "SchNet":
        from .model import SchNet

        return SchNet
    raise AttributeError(f"module 'schnet' has no attribute {name!r}")
