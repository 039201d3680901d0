"""Load a script under examples/ as a module, for tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` imported as ``<stem>_example`` (registered in sys.modules,
    which dataclasses defined in it look their module up in)."""
    path = EXAMPLES / filename
    spec = importlib.util.spec_from_file_location(f"{path.stem}_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module
