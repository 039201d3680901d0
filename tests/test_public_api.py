"""The public API: exactly the names in __all__, functions not shadowed, lean import."""

from __future__ import annotations

import inspect
import subprocess
import sys

import remat
import remat.plan.planner  # noqa: F401  (importing submodules must not shadow the functions)
import remat.validate.pitfalls  # noqa: F401


def test_all_is_exactly_the_public_names() -> None:
    public = {n for n in vars(remat) if not n.startswith("_")}
    submodules = {n for n in public if inspect.ismodule(getattr(remat, n))}
    assert set(remat.__all__) == public - submodules
    assert remat.__all__ == sorted(remat.__all__)


def test_verbs_are_functions_not_subpackages() -> None:
    for name in ("apply", "remove", "profile", "plan", "auto", "validate", "find_blocks"):
        assert inspect.isfunction(getattr(remat, name)), name


def test_import_does_not_initialize_cuda_or_load_optional_libraries() -> None:
    code = (
        "import sys, remat, torch; "
        "assert not torch.cuda.is_initialized(); "
        "assert 'matplotlib' not in sys.modules and 'transformers' not in sys.modules; "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
