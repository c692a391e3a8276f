"""Load a repository script (``flows/``, ``benchmarks/``) as a module, so a test can call its
functions: the scripts are run by path, not installed, so a plain import cannot reach them."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from dgr2.config import PROJECT_ROOT


def load_script(relative_path: str, name: str | None = None, register: bool = False) -> ModuleType:
    """Execute ``PROJECT_ROOT / relative_path`` as a fresh module called ``name`` (default: the
    file's stem).  ``register`` puts it in ``sys.modules`` first, which a script defining
    dataclasses needs (they look their module up while the class is built); it is opt-in because
    a registered module is pickled by reference, which Ray workers could not import."""
    path = PROJECT_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no script at {path}")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
