"""The public API: exactly the names in __all__, functions not shadowed, lean import."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import remat
import remat.planning.planner  # noqa: F401  (importing subpackages must not shadow the verbs)
import remat.strategies.pitfalls  # noqa: F401
import remat.validation.parity  # noqa: F401


def test_all_is_exactly_the_public_names_and_each_resolves() -> None:
    assert remat.__all__ == sorted(remat.__all__)
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name
    public = {n for n in vars(remat) if not n.startswith("_")}
    submodules = {n for n in public if inspect.ismodule(getattr(remat, n))}
    helpers = {"annotations", "importlib", "TYPE_CHECKING", "Any"}
    assert public - submodules - helpers == set(remat.__all__)
    assert set(remat.__all__) <= set(dir(remat))


def test_verbs_are_functions_not_subpackages() -> None:
    for name in ("apply", "remove", "profile", "plan", "auto", "validate", "find_blocks"):
        assert inspect.isfunction(getattr(remat, name)), name
    assert inspect.ismodule(importlib.import_module("remat.planning"))


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        remat.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("remat.no_such_name did not raise")


def test_import_is_lean_and_does_not_initialize_cuda() -> None:
    code = (
        "import sys, remat; "
        "assert 'torch' not in sys.modules, 'import remat loaded torch'; "
        "n = len([m for m in sys.modules if m.startswith('remat')]); "
        "remat.Plan; import torch; "
        "assert not torch.cuda.is_initialized(); "
        "assert 'matplotlib' not in sys.modules and 'transformers' not in sys.modules; "
        "assert 'jax' not in sys.modules; "
        "print(n)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == 1  # only the remat package itself
