"""The public API: exactly the names in __all__, loaded lazily, no CUDA at import."""

from __future__ import annotations

import subprocess
import sys

import remat


def test_all_names_resolve() -> None:
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name
    assert remat.__all__ == sorted(remat.__all__)
    assert set(remat.__all__) == set(remat._EXPORTS)


def test_import_is_lean() -> None:
    code = (
        "import sys, remat; import torch; "
        "assert not torch.cuda.is_initialized(); "
        "assert 'remat.plan' not in sys.modules and 'matplotlib' not in sys.modules; "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_unknown_attribute() -> None:
    try:
        remat.does_not_exist  # noqa: B018
    except AttributeError as err:
        assert "does_not_exist" in str(err)
    else:
        raise AssertionError("expected AttributeError")
