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


def test_readme_your_model_quickstart_runs_on_a_model_of_ones_own() -> None:
    import torch
    from torch import nn

    import remat

    class MyModel(nn.Module):  # a model remat has never seen: blocks found by its rules
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    def my_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return output.square().mean()

    torch.manual_seed(0)
    loader = [torch.randn(64, 32)]
    fresh = MyModel().train()
    none_peak = remat.profile(fresh, loader[0], loss_fn=my_loss, timing=False,
                              optimizer=torch.optim.AdamW(fresh.parameters())).peak_bytes
    block = next(b for b in _python_blocks() if "MyModel()" in b)
    block = block.replace('"12GiB"', str(none_peak - 1))  # a budget this tiny model needs
    scope: dict[str, object] = {"MyModel": MyModel, "loader": loader, "my_loss": my_loss}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    plan, model = scope["plan"], scope["model"]
    assert isinstance(plan, remat.Plan) and isinstance(model, nn.Module)
    assert plan.decisions  # something is checkpointed
    assert plan.allocator_peak_bytes is not None and plan.allocator_peak_bytes < none_peak
    assert remat.strategies.applied(model) is not None
    assert remat.validate(model, loader[0], plan, loss_fn=my_loss).passed


def test_the_walk_through_one_plan_call_names_code_that_exists() -> None:
    """docs/architecture.md's "life of one remat.plan call": every ``path.py: name`` is a
    function or class of that module, every other function or class it names exists."""
    import ast

    root = README.parent
    text = (root / "docs" / "architecture.md").read_text()
    walk = text[text.index("## The life of one"):text.index("## Adding things")]
    src = root / "src" / "remat"
    defined: dict[Path, set[str]] = {}
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defined[path] = {n.name for n in ast.walk(tree) if isinstance(
            n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    everywhere = set().union(*defined.values())
    located = re.findall(r"`([a-z_/]+\.py): ([A-Za-z_.]+)`", walk)
    assert len(located) >= 15, located
    for where, name in located:
        modules = [p for p in defined if p.as_posix().endswith("/" + where)]
        assert modules, f"{where} (for {name}) is no module of src/remat"
        assert any(name.split(".")[-1] in defined[p] for p in modules), (where, name)
    named = {n.split(".")[-1] for n in re.findall(r"`([A-Za-z_][\w.]*)`", walk)}
    functions = {n for n in named if "_" in n.strip("_") and n.islower()}
    classes = {n for n in named if n[0].isupper() and not n.isupper() and n.isidentifier()}
    assert len(functions) >= 10 and len(classes) >= 3, (functions, classes)
    for name in sorted(functions | classes):
        assert name in everywhere or re.search(rf"^\s*{name}\s*[:=]", "".join(
            p.read_text() for p in defined), re.M), f"the walk names {name}: not in src/remat"


def test_readme_gradient_accumulation_prints_what_it_shows(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The gradient-accumulation example prints the README's output, byte for byte."""
    text = README.read_text()
    block, shown = re.search(r"```python\n([^`]*accumulating=accumulating[^`]*)```\n\n"
                             r"```text\n(.*?)```", text, flags=re.S).groups()  # type: ignore[union-attr]
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    assert capsys.readouterr().out == shown
    # "in an accumulation loop its second micro-step peaks at ..., over the budget"
    import copy

    import torch

    import remat
    from accumulation_job import accumulation_peak

    model, batch = scope["model"], scope["batch"]
    first = remat.plan(model, batch, budget="3.2MiB",  # type: ignore[arg-type]
                       optimizer=torch.optim.AdamW(model.parameters()))  # type: ignore[attr-defined]
    work = copy.deepcopy(model)
    remat.apply(work, first)  # type: ignore[arg-type]
    peak = accumulation_peak(work, batch, torch.optim.AdamW(work.parameters()),  # type: ignore[arg-type]
                             cycles=2)
    said = re.search(r"second micro-step peaks at ([0-9.]+ MiB), over the budget", text)
    assert said is not None and remat.format_bytes(peak) == said.group(1)
    assert peak > first.budget_bytes
