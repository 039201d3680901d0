"""scripts/support_matrix.py: a family's row checks what it says, and the README's support
table is the script's output (a row re-run here equals the README's line)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    name = "support_matrix_script"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "support_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _readme_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- support:start -->", 1)[1].split("<!-- support:end -->", 1)[0]
    return {line.split("|")[1].strip(): line for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| model")}


def test_the_readme_table_covers_every_kind_the_matrix_promises() -> None:
    script = _script()
    rows = _readme_rows()
    assert set(rows) == {f.name for f in script.FAMILIES.values()}
    assert len(rows) >= 15
    kinds = " ".join(f.kind for f in script.FAMILIES.values())
    for kind in ("speech", "vision", "encoder-decoder", "masked LM", "mixture of experts",
                 "data-dependent", "state-space", "CNN"):
        assert kind in kinds, kind
    assert all("**" not in line for line in rows.values()), "a failed check in the README"


@pytest.mark.parametrize("key", ["vit", "bert"])
def test_a_row_rerun_equals_the_readme_and_passes_its_checks(key: str) -> None:
    torch.set_num_threads(1)
    script = _script()
    row = script.run(key)
    assert row.failures == []
    assert abs(row.profile_error) <= script.PROFILE_TOLERANCE
    assert row.full_share < 1.0 and row.fits and row.grad_error <= script.RTOL
    assert script.readme_line(row) == _readme_rows()[row.family.name]

