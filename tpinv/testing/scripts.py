"""The repository's command-line scripts (``launch/``, ``tools/``) as modules, for tests that call
their ``main(argv)`` in-process: the same code a user runs, without a subprocess."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

__all__ = ["REPO_ROOT", "load_script"]

#: The repository root (this package's grandparent), where ``launch/`` and ``tools/`` live.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(rel_path: str) -> ModuleType:
    """A fresh module of the script at ``rel_path`` (e.g. ``"tools/convert_hf.py"``) under
    :data:`REPO_ROOT`, named by its file, not registered in ``sys.modules``."""
    path = os.path.join(REPO_ROOT, rel_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such script (the tests run from a checkout of the repository)")
    spec = importlib.util.spec_from_file_location(os.path.basename(rel_path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
