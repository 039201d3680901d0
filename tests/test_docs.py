"""The code the README shows runs: the quickstart's plan lines and loading a plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_loads_plans_with_a_line_that_works(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import remat
    from remat.models import build_model, make_batch

    block = next(b for b in _python_blocks() if "Plan.from_json" in b)
    model = build_model("gpt-tiny")
    plan = remat.plan(model, make_batch(model, 2), budget="90%")
    monkeypatch.chdir(tmp_path)
    scope = {"remat": remat, "plan": plan, "model": model}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    assert scope["plan"] == plan
    assert remat.strategies.applied(model) is not None
    assert (tmp_path / "plan.json").read_text() == plan.to_json()


def test_every_documented_plan_loader_names_an_existing_attribute() -> None:
    root = README.parent
    texts = [README.read_text(), *(p.read_text() for p in (root / "docs").glob("*.md")),
             *(p.read_text() for p in (root / "src" / "remat" / "cli").glob("*.py"))]
    loaders = {m for text in texts for m in re.findall(r"(remat(?:\.\w+)*)\.from_json", text)}
    import importlib

    import remat

    for dotted in loaders:
        obj: object = remat
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(
                f"{obj.__name__}.{part}")  # type: ignore[attr-defined]
        assert callable(obj.from_json), dotted  # type: ignore[attr-defined]
