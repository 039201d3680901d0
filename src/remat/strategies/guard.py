"""The shape guard: an applied plan checks each training batch against the shapes it was
made for, before the forward allocates anything.

NOTE [ Shape guard ]
    ``remat.apply(model, plan)`` with a plan that records its shape envelope (NOTE [ Shape
    envelope ] in remat/core/shapes.py) registers one forward pre-hook (``with_kwargs``)
    on the model it was given, a :class:`ShapeGuard`. Before the forward runs, the hook
    reads the call's tensor inputs by path (``remat.measure.shapes.call_shapes``) and
    compares each shape with the envelope's: a few integer comparisons per input, no
    tensor allocated, nothing synchronized. A batch inside runs as it is. Outside, by
    ``on_new_shape``:

    * ``"error"`` (the default): :class:`~remat.errors.ShapeOutsidePlan`, naming the
      input, its shape, the plan's shapes, its budget and the fixes;
    * ``"warn"``: a :class:`~remat.errors.RematWarning` once per shape bucket, and the
      step runs with the plan as it is (its budget no longer holds);
    * ``"replan"``: NOTE [ Replanning from the guard ];
    * ``"off"``: no hook at all.

    Only training forwards are checked (the module in train mode, gradients enabled): a
    forward without autograd keeps no activations for a backward, so the plan's budget
    says nothing about it; nor are remat's own measurements (``remat.profile`` runs in
    ``remat.measure.shapes.unguarded``: a plan measured at another shape is a question,
    not a training step). The hook is removed by ``remat.remove`` and by applying
    anything else; a trial of other strategies (``preserved_strategy``, the planner's
    closed loop, ``remat.validate``) puts it back with the plan. It is a hook, not a
    parameter or a buffer: ``state_dict()`` does not change.

NOTE [ Replanning from the guard ]
    With ``on_new_shape="replan"`` a batch outside the envelope gets a plan for its shape
    bucket (NOTE [ Shape buckets ]): the applied plan whose envelope holds the batch if
    one does (the original plan, or one made for an earlier bucket), else a new one,
    planned once and cached under the bucket. A new plan is made by ``remat.plan`` on the
    model with every strategy and this hook removed, with the original plan's budget in
    bytes and ``blocks``, and the ``replan_with`` keyword arguments (``optimizer=``,
    ``loss_fn=``: ``remat.auto`` passes its own), for a batch grown to the bucket by
    repeating the batch's own slices (``grown_call``); where the model refuses the grown
    batch (a position table shorter than the bucket) or no plan fits the bucket, for the
    batch's own shapes. It all happens inside the hook, before the forward: outside the
    user's autograd graph (the planner's own steps restore parameters, gradients,
    optimizer state and RNG), and while the blocks' forwards have not run yet, so the
    regions installed now are the ones this call runs, and gradients are as exact as
    with any plan. One exception: a chunked output head (``chunked_head``) installs on
    the model's own forward, which this call already holds; a change of the head's
    decision applies from the next call. The guard lives in the strategies layer, below
    the planner it calls: ``remat.planning`` registers its replanning function
    (:func:`set_replanner`) when it is imported, which every ``Plan`` is made by.

NOTE [ Shape guard under torch.compile ]
    The guard stays on a compiled model (``torch.compile(model)`` or ``model.compile()``
    after ``remat.apply``): Dynamo traces the hook as a frame of its own, before the
    forward's (tests/strategies/test_guard.py counts no graph break): shape comparisons
    and dictionary reads are what it traces best, and they become the compiled frame's
    guards, so inside the envelope a compiled step runs no extra Python and recompiles
    only where the model's forward would. ``"error"`` raises as in eager mode and
    ``"warn"`` warns (a graph break at the error or the warning, outside the envelope
    only). ``"replan"`` needs an eager call (it runs the planner), so under
    ``torch.compile`` a batch outside the envelope raises
    :class:`~remat.errors.ShapeOutsidePlan` saying so. A plan made by
    ``remat.plan_compiled`` (it compiles blocks itself) is applied without the guard.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from remat.core.shapes import InputShapes, ShapeEnvelope, shapes_label
from remat.errors import BudgetTooSmall, RematError, RematWarning, ShapeOutsidePlan, message
from remat.measure.shapes import UNGUARDED, call_shapes, grown_call, positional_names
from remat.units import format_bytes

#: ``(model, batch, plan, replan_with) -> plan``: a plan for ``batch`` with ``plan``'s
#: budget (NOTE [ Replanning from the guard ]).
Replanner = Callable[[nn.Module, Any, Any, Mapping[str, Any]], Any]
#: ``(model, plan or None, blocks)``: put a plan's decisions on the model, or (``None``)
#: remove every strategy and the guard.
Switch = Callable[[nn.Module, Any, Any], None]

_REPLANNER: list[Replanner] = []
_FIXES = ("plan for the largest shape the loader yields (remat.plan(model, batch, "
          "budget=..., shapes=[...]) plans the largest and proves the others), find the "
          "longest sequence a budget fits with remat.plan_seq_len, or apply the plan with "
          'on_new_shape="warn" (run it anyway) or "replan" (plan once per shape bucket)')
_WARN_FIXES = ("plan for the largest shape the loader yields (remat.plan(..., shapes=[...])), "
               'or apply the plan with on_new_shape="replan" (plan once per shape bucket)')


def set_replanner(replanner: Replanner) -> None:
    """Set the function ``on_new_shape="replan"`` plans with (NOTE [ Replanning from the
    guard ]); ``remat.planning`` sets ``remat.plan`` when it is imported."""
    _REPLANNER[:] = [replanner]


class ShapeGuard:
    """The forward pre-hook an applied plan checks batch shapes with (NOTE [ Shape guard ]).

    Read it with :func:`shape_guard`; ``remat.apply`` installs it and ``remat.remove``
    removes it.

    Args:
        model: the model the plan is applied to (its ``forward`` names positional inputs).
        plan: the applied plan, with ``shape_envelope`` set.
        on_new_shape: ``"error"``, ``"warn"`` or ``"replan"``.
        switch: puts a plan's decisions on the model (``remat.strategies.apply``'s).
        blocks: the ``blocks=`` spec the plan is applied with.
        replan_with: keyword arguments of ``remat.plan`` for a replan. Default: none.

    Attributes:
        plan: the plan applied by ``remat.apply``.
        active: the plan whose decisions are on the model now (``plan``, or a replan).
        replanned: the plans made by ``"replan"``, by shape bucket.
    """

    def __init__(self, model: nn.Module, plan: Any, *, on_new_shape: str, switch: Switch,
                 blocks: Any = None, replan_with: Mapping[str, Any] | None = None) -> None:
        self.plan = plan
        self.active = plan
        self.on_new_shape = on_new_shape
        self.replanned: dict[InputShapes, Any] = {}
        self.replan_with = dict(replan_with or {})
        self._envelope: ShapeEnvelope = plan.shape_envelope
        self._names = positional_names(model)
        self._switch = switch
        self._blocks = blocks
        self._warned: set[InputShapes] = set()
        self._model_name = type(model).__name__

    def __call__(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()) or UNGUARDED[0]:
            return None
        shapes = call_shapes(args, kwargs, self._names)
        if self._envelope.covers(shapes):
            return None
        self._outside(module, args, kwargs, shapes)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> ShapeGuard:
        # A model's copy (remat's fake copies, copy.deepcopy) gets a guard of its own that
        # shares the immutable plans and the replan arguments (an optimizer is not copied).
        other = copy.copy(self)
        other.replanned = dict(self.replanned)
        other._warned = set()
        return other

    # ---- outside the envelope ------------------------------------------------------------

    def _outside(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 shapes: dict[str, tuple[int, ...]]) -> None:
        if self.on_new_shape == "replan":
            if torch.compiler.is_compiling():
                raise self._error(shapes, "the batch is outside the plan's shapes, and "
                                  "on_new_shape='replan' cannot plan inside torch.compile",
                                  fix="plan for the largest shape the loader yields "
                                      "(remat.plan(..., shapes=[...])), or replan eagerly")
            self._replan(module, args, kwargs, shapes)
            return
        if self.on_new_shape == "warn":
            key = self._envelope.bucket(shapes)
            if key not in self._warned:
                self._warned.add(key)
                warnings.warn(self._message(
                    shapes, "a batch outside the shapes the applied plan was made for runs "
                    "with the plan as it is (on_new_shape='warn'; warned once per shape "
                    "bucket)", fix=_WARN_FIXES),
                    RematWarning, stacklevel=3)
            return
        raise self._error(shapes, "a batch outside the shapes the applied plan was made for",
                          fix=_FIXES)

    def _message(self, shapes: Mapping[str, tuple[int, ...]], what: str, *, fix: str,
                 facts: Mapping[str, object] | None = None) -> str:
        reasons = self._envelope.outside(shapes)
        if any(r.endswith("not an input of the plan's batch") for r in reasons):
            fix = ("plan with a batch that has every input the loader yields (an attention "
                   "mask the plan never saw can run another attention kernel); or " + fix)
        return message(f"{self._model_name}.forward with a remat plan", what, {
            "batch's shapes": shapes_label(shapes),
            "outside": "; ".join(reasons),
            "plan's shapes": self._envelope.label(),
            "plan's budget": f"{format_bytes(self.active.budget_bytes)}, measured at those "
                             "shapes: a larger input holds more activations",
            **(facts or {})}, fix=fix)

    def _error(self, shapes: Mapping[str, tuple[int, ...]], what: str, *, fix: str,
               facts: Mapping[str, object] | None = None) -> ShapeOutsidePlan:
        return ShapeOutsidePlan(self._message(shapes, what, fix=fix, facts=facts),
                                shapes=shapes, envelope=self._envelope)

    def _replan(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                shapes: dict[str, tuple[int, ...]]) -> None:
        """NOTE [ Replanning from the guard ]."""
        chosen = next((p for p in (self.plan, *self.replanned.values())
                       if p.shape_envelope.covers(shapes)), None)
        if chosen is None:
            key = self.plan.shape_envelope.bucket(shapes)
            chosen = self._plan_for(module, args, kwargs, shapes, key)
            self.replanned[key] = chosen
        self._use(module, chosen)

    def _use(self, module: nn.Module, plan: Any) -> None:
        with warnings.catch_warnings():  # the first apply warned about the model already
            warnings.simplefilter("ignore", RematWarning)
            self._switch(module, plan, self._blocks)
        install_guard(module, self)
        self.active = plan
        self._envelope = plan.shape_envelope

    def _plan_for(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  shapes: dict[str, tuple[int, ...]], bucket: InputShapes) -> Any:
        if not _REPLANNER:
            raise RematError(message(f"{self._model_name}.forward with a remat plan",
                                     "on_new_shape='replan' found no planner",
                                     fix="import remat.planning (remat.plan does)"))
        replanner = _REPLANNER[0]
        try:
            own = grown_call(args, kwargs, self._names)
            grown = grown_call(args, kwargs, self._names, bucket)
        except ValueError as exc:
            raise self._error(shapes, "on_new_shape='replan' cannot make a batch of this "
                              "call", fix=str(exc).split("fix: ")[-1]) from None
        options = {"blocks": self._blocks, **self.replan_with}
        exact = bucket == tuple(sorted(shapes.items()))  # the bucket is the batch's shape
        self._switch(module, None, self._blocks)  # the bare model; this hook off
        try:
            with torch.enable_grad():
                try:
                    return replanner(module, grown, self.plan, options)
                except BudgetTooSmall:
                    if exact:
                        raise
                except RematError:
                    raise
                except Exception:  # the model refused the grown batch
                    if exact:
                        raise
                return replanner(module, own, self.plan, options)  # the batch's own shapes
        except BudgetTooSmall as exc:
            self._use(module, self.active)
            raise self._error(
                shapes, "no plan for the new batch shape fits the plan's budget",
                facts={"smallest reachable peak": format_bytes(exc.min_peak_bytes)},
                fix="raise the budget, or keep batches within the plan's shapes") from exc
        except BaseException:
            self._use(module, self.active)  # as it was
            raise


def install_guard(model: nn.Module, guard: ShapeGuard) -> None:
    """Register ``guard`` as ``model``'s forward pre-hook (one guard per model)."""
    remove_guard(model)
    model.register_forward_pre_hook(guard, with_kwargs=True)


def remove_guard(model: nn.Module) -> ShapeGuard | None:
    """Take ``model``'s :class:`ShapeGuard` off (found among its forward pre-hooks, so a
    copy's own is found too) and return it; ``None`` when it has none."""
    found = None
    for key, hook in list(model._forward_pre_hooks.items()):
        if isinstance(hook, ShapeGuard):
            del model._forward_pre_hooks[key]
            model._forward_pre_hooks_with_kwargs.pop(key, None)
            found = hook
    return found


def shape_guard(model: nn.Module) -> ShapeGuard | None:
    """The :class:`ShapeGuard` ``remat.apply`` put on ``model``, or ``None``.

    Example:
        >>> remat.apply(model, plan, on_new_shape="replan")
        >>> shape_guard(model).replanned   # plans made so far, by shape bucket
        {}
    """
    return next((h for h in model._forward_pre_hooks.values() if isinstance(h, ShapeGuard)),
                None)
