"""scripts/compat_matrix.py: one architecture end to end, and the docs markers."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")


def _script() -> Any:
    path = Path(__file__).resolve().parents[2] / "scripts" / "compat_matrix.py"
    spec = importlib.util.spec_from_file_location("compat_matrix_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_one_architecture_gives_numbers_and_a_refusal() -> None:
    script = _script()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vit = script.run_arch(script.ARCHS["vit"], ("full",))
        bert = script.run_arch(script.ARCHS["bert"], ("mlp",))
    blocks, peak, cells = vit
    assert blocks == [f"vit.layers.{i}" for i in range(script.LAYERS)]
    full = cells["full"]
    assert full.status == "PASS" and full.max_rel_error <= 1e-6
    assert full.activation_change < -0.5 and full.peak_change < 0  # checkpointing frees memory
    assert bert[2]["mlp"].status == "n/a" and "BlocksNotFound" in bert[2]["mlp"].note
    table = script.render({"vit": vit}, ("full",), 1.0)
    assert "| ViT | `vit.layers` x4 |" in table and "PASS −" in table
    assert "n/a [1]" in script.render({"bert": bert}, ("mlp",), 1.0)


def test_write_replaces_only_between_the_markers(tmp_path: Path) -> None:
    script = _script()
    doc = tmp_path / "compat.md"
    doc.write_text(f"intro\n{script.START}\nold\n{script.END}\noutro\n")
    script.write("| new |", doc)
    assert doc.read_text() == f"intro\n{script.START}\n| new |\n{script.END}\noutro\n"
    fresh = tmp_path / "sub" / "fresh.md"
    script.write("| t |", fresh)
    assert f"{script.START}\n| t |\n{script.END}" in fresh.read_text()
