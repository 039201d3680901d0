"""scripts/compat_matrix.py and scripts/plan_matrix.py: one architecture end to end, refusals
recorded instead of raised, and the docs markers."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> Any:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))  # plan_matrix imports compat_matrix by name
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _no_blocks(script: Any) -> Any:
    """An architecture remat cannot checkpoint: one Linear, no repeated blocks."""
    return script.Arch("One Linear", lambda: nn.Linear(8, 8),
                       lambda: {"input": torch.randn(4, 8)}, "linear")


def test_one_architecture_gives_numbers_a_refusal_and_equal_simulation() -> None:
    script = _script("compat_matrix")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vit = script.run_arch(script.ARCHS["vit"], ("full",))
        bert = script.run_arch(script.ARCHS["bert"], ("mlp",), sim_strategies=())
    assert vit.blocks == [f"vit.layers.{i}" for i in range(script.LAYERS)]
    full = vit.cells["full"]
    assert full.status == "PASS" and full.max_rel_error <= 1e-6
    assert full.activation_change < -0.5 and full.peak_change < 0  # checkpointing frees memory
    for strategy in ("none", "full"):  # fake tensors give the real step's bytes exactly
        check = vit.sim[strategy]
        assert check.real_bytes == check.simulated_bytes, (strategy, check)
    assert vit.ok
    assert bert.cells["mlp"].status == "n/a" and "BlocksNotFound" in bert.cells["mlp"].note
    assert bert.ok  # a clear refusal is not a failure
    table = script.render({"vit": vit}, ("full",), 1.0)
    assert "| ViT | `vit.layers` x4 |" in table and "PASS −" in table
    assert f"| ViT | vision encoder | {vit.sim['none'].real_bytes:,} |" in table
    assert "n/a [1]" in script.render({"bert": bert}, ("mlp",), 1.0, sim_strategies=())


def test_an_architecture_that_cannot_run_is_a_row_not_a_crash() -> None:
    script = _script("compat_matrix")
    script.ARCHS["linear"] = arch = _no_blocks(script)
    try:
        result = script.run_arch(arch, ("full",))
        assert not result.ok and result.error.startswith("BlocksNotFound: ")
        table = script.render({"linear": result}, ("full",), 1.0)
        assert "| One Linear | ERROR [1] |" in table and "[1] One Linear: BlocksNotFound" in table
        mismatch = script.ArchResult(["b.0"], 10, {}, {"none": script.SimCheck(10, 12)})
        assert not mismatch.ok
        assert "| 10 | 12 | NO (+2 B) |" in script.render({"linear": mismatch}, (), 1.0)
    finally:
        del script.ARCHS["linear"]


def test_plan_matrix_rows_and_refusal() -> None:
    plan_matrix = _script("plan_matrix")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = plan_matrix.run(plan_matrix.cm.ARCHS["vit"])
        refused = plan_matrix.run(_no_blocks(plan_matrix.cm))
    assert [row.status for row in rows] == ["ok", "ok"]
    for row in rows:
        budget, peak, fits, recompute, _, error, parity, *_ = row.cells
        assert fits == "yes" and parity == "PASS" and float(error) <= 1e-6
        assert budget.startswith(("25%: ", "75%: ")) and peak.endswith("MiB")
        assert "FLOP" in recompute
    assert [row.status for row in refused] == ["refused"]
    assert refused[0].note.startswith("BlocksNotFound: ")
    table = plan_matrix.render(rows + refused)
    assert "| ViT | 25%: " in table and "| One Linear |  |  | refused [1] |" in table
    assert "[1] One Linear: BlocksNotFound" in table


def test_write_replaces_only_between_the_markers(tmp_path: Path) -> None:
    script = _script("compat_matrix")
    doc = tmp_path / "compat.md"
    doc.write_text(f"intro\n{script.START}\nold\n{script.END}\noutro\n")
    script.write("| new |", doc)
    assert doc.read_text() == f"intro\n{script.START}\n| new |\n{script.END}\noutro\n"
    fresh = tmp_path / "sub" / "fresh.md"
    script.write("| t |", fresh)
    assert f"{script.START}\n| t |\n{script.END}" in fresh.read_text()
