"""Loading the repository's scripts (benchmarks, generators), which are files, not packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path: Path):
    """The script at ``path`` as a module, without putting its folder on ``sys.path``; registered in
    ``sys.modules`` under a name of its own, where its dataclasses look their module up."""
    name = f"_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
