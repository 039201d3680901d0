"""remat's error message format (remat.errors.message) and the call names it carries."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.compare.runner import compare
from remat.core.cost import StepCost
from remat.errors import StrategyError, message, one_line, with_api


def test_message_exact() -> None:
    text = message("remat.apply", "unknown strategy 'fulll'",
                   {"valid strategies": "none, full, every:N"},
                   fix="pass one of the valid strategies")
    assert text == ("remat.apply: unknown strategy 'fulll'\n"
                    "  valid strategies: none, full, every:N\n"
                    "  fix: pass one of the valid strategies")


def test_message_pairs_multiline_and_no_fix() -> None:
    text = message("Plan", "bad entry", [("found", "a\nb"), ("budget", "1.2 GiB")])
    assert text == "Plan: bad entry\n  found: a\n    b\n  budget: 1.2 GiB"
    assert message("", "no api") == "no api"


def test_one_line_for_key_errors() -> None:
    text = message("Plan.decision", "no block 'x'", {"blocks": "a, b"}, fix="pass a block")
    assert one_line(text) == "Plan.decision: no block 'x'; blocks: a, b; fix: pass a block"


def test_with_api() -> None:
    assert with_api("remat.plan", "bad\n  fix: x") == "remat.plan: bad\n  fix: x"
    assert with_api("remat.plan", "remat.plan: bad") == "remat.plan: bad"
    assert with_api("", "bad") == "bad"


def _model_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    return model, torch.randn(2, 4)


@pytest.mark.parametrize("text", ["every:x", "fulll", "full:2"])
def test_strategy_errors_name_the_call(text: str) -> None:
    model, batch = _model_batch()
    calls = {
        "remat.apply": lambda: remat.apply(model, text),
        "remat.validate": lambda: remat.validate(model, batch, text),
        "remat.compare": lambda: compare(lambda: _model_batch()[0], batch, [text],
                                         repeats=0),
    }
    for api, call in calls.items():
        with pytest.raises(StrategyError) as info:
            call()
        lines = str(info.value).splitlines()
        assert lines[0].startswith(f"{api}: "), lines
        assert lines[-1].startswith("  fix: "), lines


def test_bad_blocks_name_the_call() -> None:
    model, batch = _model_batch()
    calls = {
        "remat.apply": lambda: remat.apply(model, "full", blocks=int),
        "remat.validate": lambda: remat.validate(model, batch, "full", blocks=int),
        "remat.compare": lambda: compare(lambda: _model_batch()[0], batch, ["full"],
                                         blocks=int, repeats=0),
        "remat.profile": lambda: remat.profile(model, batch, blocks=int),
    }
    for api, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{api}: blocks=int is not an nn.Module "
                                            r"subclass\n  fix: pass blocks="):
            call()


def test_a_plan_for_another_model_names_the_call() -> None:
    from remat.models import build_model, make_batch
    from remat.planning import Plan
    from remat.planning.fingerprint import fingerprint_of
    from remat.strategies.builtin import Full

    small = build_model("gpt-tiny", n_layer=2)
    names = tuple(n for n, _ in remat.blocks.named_blocks(small))
    plan = Plan({n: Full() for n in names}, names, 1, StepCost(peak_bytes=1),
                fingerprint=fingerprint_of(small, names))
    big = build_model("gpt-tiny", n_layer=4)
    for api, call in {"remat.apply": lambda: remat.apply(big, plan),
                      "remat.validate": lambda: remat.validate(big, make_batch(big, 2), plan),
                      }.items():
        with pytest.raises(StrategyError, match=rf"(?s)^{api}: this plan was made for another "
                                                r"model.*\n  fix: make a plan for this model"):
            call()


#: Raises whose text is not a user-facing message, each with the reason.
_NOT_MESSAGES = {
    ("units.py", "AssertionError"): "an unreachable branch, not an error a user meets",
    ("__init__.py", "AttributeError"): "module __getattr__: Python's own wording",
    ("simulate/__init__.py", "AttributeError"): "module __getattr__: Python's own wording",
    ("simulate/run.py", "AttributeError"): "module __getattr__: Python's own wording",
    ("strategies/registry.py", "ValueError"): "caught at once and re-raised as a message",
    ("cli/options.py", "IsADirectoryError"): "caught at once and re-raised as a message",
    ("core/snapshot.py", "_Refused"): "caught at once and re-raised as a message",
}


def test_every_raise_builds_its_text_with_message() -> None:
    # NOTE [ Error message format ]: a raise whose text is a literal or an f-string was
    # written by hand; its format drifts from the others'.
    import ast
    from pathlib import Path

    src = Path(remat.__file__).parent
    by_hand: list[str] = []
    for path in sorted(src.rglob("*.py")):
        rel = str(path.relative_to(src))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and node.exc.args):
                continue
            first = node.exc.args[0]
            hand = isinstance(first, ast.JoinedStr) or (
                isinstance(first, ast.Constant) and isinstance(first.value, str)) or (
                isinstance(first, ast.BinOp) and not any(
                    isinstance(n, ast.Call) for n in ast.walk(first)))
            name = ast.unparse(node.exc.func).rpartition(".")[2]
            if not name.lstrip("_")[:1].isupper():
                continue  # a helper (``_bad``, ``refuse``) that builds the message itself
            if hand and (rel, name) not in _NOT_MESSAGES:
                by_hand.append(f"{rel}:{node.lineno}: {name}")
    assert by_hand == [], "raises with hand-built text (use remat.errors.message):\n" + \
        "\n".join(by_hand)
