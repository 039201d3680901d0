"""Each backend loads only its own framework: the core between them imports neither.

Run in fresh interpreters, so that what the test process already imported does not hide
an import.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


def _loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after running ``code``."""
    probe = (f"{code}; import json, sys; "
             f"print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    loaded: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.skipif(importlib.util.find_spec("jax") is None
                    or importlib.util.find_spec("flax") is None,
                    reason="needs the jax extra")
def test_import_remat_jax_loads_neither_torch_nor_scipy() -> None:
    code = ("import remat.jax as rj; "
            "rj.plan, rj.profile, rj.auto, rj.validate, rj.compare, rj.apply, rj.Plan")
    assert _loaded_after(code, ("torch", "scipy")) == []


def test_import_remat_and_its_verbs_load_no_jax() -> None:
    code = ("import remat; "
            "remat.plan, remat.profile, remat.apply, remat.auto, remat.validate, "
            "remat.Profile, remat.ParityReport, remat.Plan")
    assert _loaded_after(code, ("jax", "jaxlib", "flax")) == []


def test_the_core_loads_no_framework_and_scipy_only_to_solve() -> None:
    code = ("import remat.core.budget, remat.core.checks, remat.core.op_record, remat.core.parity, "
            "remat.core.peak, remat.core.results, remat.core.rows, remat.core.solver, "
            "remat.core.cost")
    assert _loaded_after(code, ("torch", "jax", "flax", "scipy")) == []


def test_the_core_imports_only_the_lowest_layer() -> None:
    """remat.core may import remat.errors, remat.units, remat.native and itself: no
    framework-bound module of its own layer (blocks, devices, models) either."""
    import ast
    from pathlib import Path

    import remat.core

    allowed = ("remat.core", "remat.errors", "remat.units", "remat.native")
    outside = []
    for path in sorted(Path(remat.core.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            outside += [f"{path.name}: {n}" for n in names
                        if n.split(".")[0] in ("remat", "torch", "jax", "flax")
                        and not n.startswith(allowed)]
    assert outside == []


def test_import_remat_loads_no_training_stack() -> None:
    """The integrations are imported on demand: ``import remat`` and its verbs, and the
    integrations package itself, load none of the training frameworks."""
    code = ("import remat, remat.integrations; "
            "remat.plan, remat.profile, remat.apply, remat.validate, remat.Plan")
    stacks = ("lightning", "pytorch_lightning", "peft", "trl", "accelerate", "transformers")
    assert _loaded_after(code, stacks) == []
