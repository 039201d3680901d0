"""benchmarks/gpu_reserved.py's CPU dry run prints the predictions (the CUDA path measures
the same cases, each in a process of its own)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_reserved.py"


def test_gpu_reserved_dry_run(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("remat_gpu_reserved", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "reserved.json"
    argv = ["--dry-run", "--models", "gpt-tiny", "--strategies", "none", "full",
            "--batch", "2", "--json", str(out)]
    result = module.main(argv)
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {(r["strategy"], r["settings"]): r for r in result["rows"]}
    assert set(rows) == {(s, c) for s in ("none", "full")
                         for c in ("", "expandable_segments:True")}
    for row in rows.values():
        assert row["predicted_steady_reserved"] >= row["predicted_steady_allocated"] \
            >= row["tracker_peak"] > 0
        assert row["predicted_steady_reserved"] >= row["predicted_first_reserved"]
        assert "measured_first_reserved" not in row
    # checkpointing lowers the live bytes; the settings do not change them
    assert rows[("full", "")]["tracker_peak"] < rows[("none", "")]["tracker_peak"]
    assert rows[("none", "")]["tracker_peak"] == rows[("none", "expandable_segments:True")][
        "tracker_peak"]
    table = module.render(result)
    assert table.startswith("Command: `python benchmarks/gpu_reserved.py --dry-run")
    assert "| gpt-tiny | full | expandable_segments:True | steady |" in table
    assert "measured reserved" not in table
