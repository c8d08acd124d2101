"""Loading the repository's scripts (benchmarks, generators), which are files, not packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def load_script(path: Path):
    """The script at ``path`` as a module, without putting its folder on ``sys.path``."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
