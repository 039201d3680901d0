"""Bad inputs to the public API: each fails with a remat error that says what to do.

Every row calls the public API the way a user would get it wrong and checks the
exception's type, the call its first line names and a fragment of its ``fix:`` line.
None may be an internal traceback: the exception is a remat error, a ValueError or a
TypeError in remat's message format (``remat.errors.message``) whose first line starts
with the call the user made (``remat.plan: ...``, or ``remat: ...`` where the check is
shared by every verb), never an AttributeError or KeyError from deep inside.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.cost import StepCost
from remat.models import build_model, make_batch
from remat.planning import Plan
from remat.planning.fingerprint import fingerprint_of
from remat.strategies.builtin import Full


@dataclass(frozen=True)
class Case:
    """One bad input: what to call, the exception expected, and the fix it must name."""

    id: str
    call: Callable[[], Any]
    error: type[BaseException]
    fix: str  # a regex fragment of the message that says what to do
    api: str  # the call the first line names (``remat`` where every verb shares the check)


def _model(preset: str = "gpt-tiny", **overrides: Any) -> nn.Module:
    return build_model(preset, **overrides)


def _batch(model: nn.Module) -> Any:
    return make_batch(model, 2)


def _plan(budget: Any) -> Callable[[], Any]:
    def call() -> Any:
        model = _model()
        return remat.plan(model, _batch(model), budget=budget)
    return call


def _apply(strategy: Any, blocks: Any = None) -> Callable[[], Any]:
    return lambda: remat.apply(_model(), strategy, blocks=blocks)


def _plan_file(mutate: Callable[[dict[str, Any]], Any]) -> Callable[[], Any]:
    def call() -> Any:
        model = _model()
        names = tuple(n for n, _ in remat.blocks.named_blocks(model))
        plan = Plan(decisions={names[0]: Full()}, block_names=names,
                    budget_bytes=1, cost=StepCost(peak_bytes=1),
                    fingerprint=fingerprint_of(model, names))
        data = json.loads(plan.to_json())
        result = mutate(data)
        return Plan.from_json(result if isinstance(result, str) else json.dumps(data))
    return call


def _save_ops_string(data: dict[str, Any]) -> None:
    data["decisions"]["blocks.0"] = {"kind": "ops", "save_ops": "aten.mm"}


def _jax(data: dict[str, Any]) -> None:
    data["framework"] = "jax"


def _other_model() -> Any:
    small = _model(n_layer=2)
    names = tuple(n for n, _ in remat.blocks.named_blocks(small))
    plan = Plan(decisions={n: Full() for n in names}, block_names=names,
                budget_bytes=1, cost=StepCost(peak_bytes=1),
                fingerprint=fingerprint_of(small, names))
    return remat.apply(_model(n_layer=6), Plan.from_json(plan.to_json()))


def _profile(model_fn: Callable[[], nn.Module], batch: Any = None, **kw: Any
             ) -> Callable[[], Any]:
    def call() -> Any:
        model = model_fn()
        return remat.profile(model, _batch(model) if batch is None else batch, timing=False,
                             **kw)
    return call


def _frozen() -> nn.Module:
    return _model().requires_grad_(False)


def _meta() -> nn.Module:
    with torch.device("meta"):
        return _model()


def _validate_no_grad() -> Any:
    model = _model()
    batch = _batch(model)
    with torch.no_grad():
        return remat.validate(model, batch, "full")


def _validate(strategy: str) -> Callable[[], Any]:
    def call() -> Any:
        model = _model()
        return remat.validate(model, _batch(model), strategy)
    return call


def _validate_empty_batch() -> Any:
    return remat.validate(_model(), {}, "full")


def _empty_container() -> Any:
    model = _model()
    model.extra = nn.ModuleList()
    return remat.apply(model, "full", blocks=lambda name, module: name == "extra")


CASES = [
    # budgets
    Case("budget -5%", _plan("-5%"), ValueError,
         r"percentage > 0.*fix: write budget as bytes", "remat.plan"),
    Case("budget abc", _plan("abc"), ValueError,
         r"cannot read budget 'abc'.*fix: write budget as bytes", "remat.plan"),
    Case("budget 0", _plan(0), ValueError,
         r"must be > 0 bytes.*fix: write budget as bytes", "remat.plan"),
    Case("budget 12 parsecs", _plan("12 parsecs"), ValueError,
         r"cannot read budget.*fix: write budget as bytes", "remat.plan"),
    Case("budget 1e30", _plan("1e30"), ValueError,
         r"reason: not a byte count remat can hold.*fix: write budget as bytes", "remat.plan"),
    Case("budget inf bytes", _plan(float("inf")), ValueError,
         r"cannot read budget inf.*fix: write budget as bytes", "remat.plan"),
    # strategies
    Case("strategy every:0", _apply("every:0"), remat.StrategyError, r"fix: write every:N",
         "remat.apply"),
    Case("strategy 3", _apply(3), remat.StrategyError,
         r"must be a string.*valid strategies:.*fix: pass .*a Plan from remat.plan",
         "remat.apply"),
    Case("strategy fulll", _apply("fulll"), remat.StrategyError,
         r"full.*fix: pass one of the valid strategies", "remat.apply"),
    # block specs
    Case("blocks match nothing", _apply("full", lambda n, m: n == "nope"), remat.BlocksNotFound,
         r"matched no submodule.*fix: pass blocks=", "remat.apply"),
    Case("blocks match an empty container", _empty_container, remat.BlocksNotFound,
         r"matched only empty containers \(extra\).*fix: pass blocks=", "remat.apply"),
    Case("blocks a non-module class", _apply("full", int), TypeError,
         r"not an nn.Module subclass.*fix: pass blocks=", "remat.apply"),
    # plan files
    Case("plan not JSON", _plan_file(lambda d: "{not json"), ValueError,
         r"not valid JSON.*fix: pass the text plan.to_json\(\) wrote", "remat.Plan.from_json"),
    Case("plan wrong format", _plan_file(lambda d: json.dumps({"format": "other"})), ValueError,
         r"fix: write plans with plan.to_json\(\)", "remat.Plan.from_json"),
    Case("plan for jax", _plan_file(_jax), ValueError,
         r"fix: load it with remat.jax.Plan.from_json", "remat.Plan.from_json"),
    Case("plan save_ops a string", _plan_file(_save_ops_string), ValueError,
         r"fix: write a list of op names: \['aten.mm'\]", "remat.Plan.from_json"),
    Case("plan for another model", _other_model, remat.StrategyError,
         r"made for another model.*fix: make a plan for this model with remat.plan\(model, batch",
         "remat.apply"),
    # models and batches
    Case("model in eval mode", _profile(lambda: _model().eval()), ValueError,
         r"fix: call model.train\(\)", "remat.profile"),
    Case("no trainable parameter", _profile(_frozen), ValueError,
         r"fix: unfreeze some with p.requires_grad_\(True\)", "remat.profile"),
    Case("meta model without simulate", _profile(_meta), ValueError, r"fix: pass simulate=True",
         "remat.profile"),
    Case("batch of the wrong type", _profile(_model, batch="hello"), TypeError,
         r"batch must be a Tensor.*fix: pass the inputs your model's forward takes", "remat"),
    Case("batch with an unknown key", _profile(_model, batch={"tokens": torch.zeros(2, 8)}),
         remat.BatchRejected, r"call: model\(\*\*batch\) on GPT\n  batch: tokens: float32\[2, 8\]"
         r".*fix: pass a batch the model's forward takes", "remat.profile"),
    Case("batch of the wrong dtype", _profile(_model, batch=torch.zeros(2, 8)),
         remat.BatchRejected, r"raised RuntimeError.*batch: float32\[2, 8\].*'indices'"
         r".*fix: pass a batch", "remat.profile"),
    Case("batch with a missing input", _validate_empty_batch, remat.BatchRejected,
         r"call: model\(\*\*batch\).*batch: \{\}.*fix: pass a batch", "remat.validate"),
    Case("validate under no_grad", _validate_no_grad, remat.RematError,
         r"fix: call remat.validate outside torch.no_grad\(\)", "remat.validate"),
    Case("validate strategy every:x", _validate("every:x"), remat.StrategyError,
         r"fix: write every:N", "remat.validate"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_with_a_remat_message_that_says_what_to_do(case: Case) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as info:
            case.call()
    exc = info.value
    assert isinstance(exc, case.error), f"{case.id}: {type(exc).__name__}: {exc}"
    assert isinstance(exc, (remat.RematError, ValueError, TypeError)), repr(exc)
    message = str(exc)
    assert re.match(r"remat[.:]", message), f"{case.id}: not a remat message: {message!r}"
    assert message.startswith(f"{case.api}: "), f"{case.id}: does not name {case.api}: {message}"
    assert re.search(case.fix, message, flags=re.DOTALL), (
        f"{case.id}: message does not say {case.fix!r}: {message}")
    # remat.errors.message's format: the call and what is wrong, facts, then the fix
    first, *rest = message.splitlines()
    assert len(first) <= 120 and rest and rest[-1].startswith("  fix: "), (
        f"{case.id}: not in remat's message format: {message}")


def test_a_rejected_batch_chains_the_models_own_error() -> None:
    model = _model()
    with pytest.raises(remat.BatchRejected) as info:
        remat.profile(model, {"tokens": torch.zeros(2, 8)}, timing=False)
    assert isinstance(info.value.__cause__, TypeError)
    assert "tokens" in str(info.value.__cause__)
    assert isinstance(info.value, TypeError)  # ``except TypeError`` still catches it


def test_the_outermost_call_names_the_error() -> None:
    model = _model()
    with pytest.raises(remat.BatchRejected, match=r"^remat\.auto: the model raised"):
        remat.auto(model, {"tokens": torch.zeros(2, 8, dtype=torch.long)}, budget="50%")
