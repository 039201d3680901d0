"""remat stays jax-free; remat.jax names its extra when jax is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_remat_does_not_import_jax() -> None:
    # every module of the PyTorch side, the CLI included
    # (pkgutil.walk_packages would import remat.jax itself to look inside it)
    result = _run("import importlib, pathlib, sys, remat; "
                  "root = pathlib.Path(remat.__file__).parent; "
                  "names = ['.'.join(('remat',) + p.relative_to(root).with_suffix('').parts) "
                  "for p in root.rglob('*.py')]; "
                  "[importlib.import_module(n.removesuffix('.__init__')) for n in names "
                  "if not n.startswith('remat.jax')]; "
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('jax', 'jaxlib', 'flax')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_missing_jax_names_the_extra() -> None:
    result = _run("import sys; sys.modules['jax'] = None; import remat.jax")
    assert result.returncode != 0
    assert "pip install 'remat[jax]'" in result.stderr


def test_public_api() -> None:
    import inspect

    import remat.jax as rj

    public = {n for n in vars(rj) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(rj, n))}
    assert set(rj.__all__) == public - modules
    assert rj.__all__ == sorted(rj.__all__)
    for verb in ("apply", "remove", "profile", "plan", "auto", "validate", "compare"):
        assert inspect.isfunction(getattr(rj, verb)), verb


#: The only remat packages remat.jax may import besides itself: never the PyTorch side.
_SHARED = ("remat.jax", "remat.core", "remat.errors", "remat.units")


@pytest.mark.parametrize("module", ["analysis", "block_measure", "blocks", "candidates", "chains",
                                    "compare", "loop", "measure", "models", "planner", "plans",
                                    "policies", "strategies", "validate"])
def test_shared_internals_only_from_the_core(module: str) -> None:
    """remat.jax imports remat's framework-neutral core, errors and units, nothing else."""
    from pathlib import Path

    import remat.jax

    text = (Path(remat.jax.__file__).parent / f"{module}.py").read_text()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("from remat.", "import remat.")):
            target = stripped.split()[1]
            assert target.startswith(_SHARED), line
