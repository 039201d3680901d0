"""Load a file as a module: scripts under examples/, and the helpers under tests/measure/
(which are not a package) for tests in other folders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_module(path: Path, name: str) -> ModuleType:
    """``path`` imported as ``name`` (registered in sys.modules, where dataclasses defined
    in it look their module up; a module already loaded under ``name`` is reused)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` imported as ``<stem>_example``."""
    path = ROOT / "examples" / filename
    return load_module(path, f"{path.stem}_example")


def load_measure_helper(name: str) -> ModuleType:
    """``tests/measure/<name>.py`` (``allocator_util``, ``hf_tiny``) imported as ``name``."""
    return load_module(ROOT / "tests" / "measure" / f"{name}.py", name)
