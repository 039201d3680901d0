"""``remat.apply`` / ``remat.remove``: put a strategy or a plan on a model, in place."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from remat.blocks import BlockMethod, BlocksSpec, Sublayer, named_blocks, sublayer_at
from remat.core.shapes import check_on_new_shape
from remat.errors import RematWarning, StrategyError, message, with_api
from remat.strategies.base import BlockStrategy, Strategy
from remat.strategies.guard import ShapeGuard, install_guard, remove_guard, shape_guard
from remat.strategies.handler import block_handler_of, handler_of
from remat.strategies.head import HEAD_KEY, head_attributes, head_of, uninstall_head
from remat.strategies.offload import host_simulated
from remat.strategies.pitfalls import check_model, check_regions, warn_pitfalls
from remat.strategies.regions import has_region, installed_attributes, uninstall
from remat.strategies.registry import parse_strategy

M = TypeVar("M", bound=nn.Module)
_APPLIED = "_remat_applied"
#: Set on the blocks ``apply`` compiled for a plan made by ``remat.plan_compiled``.
_COMPILED_BY_PLAN = "_remat_compiled_by_plan"


@dataclass(frozen=True)
class AppliedStrategy:
    """What :func:`apply` put on a model (``remat.strategies.applied(model)``).

    Args:
        strategy: the strategy string, or ``"plan"``.
        decisions: per block qualified name, the label of the strategy it got; a decision
            on a sub-layer (a module or method inside a block) is listed by its own path
            after its block's entry.
    """

    strategy: str
    decisions: tuple[tuple[str, str], ...]


def applied(model: nn.Module) -> AppliedStrategy | None:
    """The strategy currently applied to ``model``, or ``None``."""
    info = model.__dict__.get(_APPLIED)
    return info if isinstance(info, AppliedStrategy) else None


def remove(model: M) -> M:
    """Undo :func:`apply`: every module gets its own forward back.

    Blocks that ``apply`` compiled for a plan made by ``remat.plan_compiled`` run eagerly
    again (a model the user compiled is left compiled), and the plan's shape guard goes
    (NOTE [ Shape guard ] in guard.py).

    Example:
        >>> remat.remove(remat.apply(model, "full")) is model
        True
    """
    uninstall_head(model)
    remove_guard(model)
    for module in model.modules():
        uninstall(module)
        if module.__dict__.pop(_COMPILED_BY_PLAN, False):
            module._compiled_call_impl = None
    model.__dict__.pop(_APPLIED, None)
    return model


def _offload_notice(model: nn.Module, decisions: Mapping[str, BlockStrategy]) -> None:
    handlers = {d.name: block_handler_of(d) for d in decisions.values()}
    moving = {name: h.without_host for name, h in handlers.items() if h.moves_to_host}
    if not moving:
        return
    devices = {p.device.type for p in model.parameters()}
    if devices <= {"cpu", "meta"} and not host_simulated():  # NOTE [ Simulated host ]
        names = " and ".join(sorted(moving))
        what = "; ".join(f"{name} is {done} here" if done else f"{name} moves nothing here"
                         for name, done in sorted(moving.items()))
        warnings.warn(
            message("remat.apply", what,
                    {"why": f"{names} keeps activations in host memory, but this model "
                            "is on the CPU, which has no separate device memory"},
                    fix=f"nothing to do on the CPU; {names} saves device memory on a GPU"),
            RematWarning,
            stacklevel=3,
        )


def _installed(model: nn.Module) -> bool:
    return head_of(model) is not None or any(has_region(m) for m in model.modules())


def _no_region_notice(model: nn.Module, label: str, blocks: list[str]) -> None:
    """A strategy that checkpoints something but installed no region is a silent no-op."""
    shown = ", ".join(blocks[:4]) + (f" and {len(blocks) - 4} more" if len(blocks) > 4 else "")
    warnings.warn(
        message("remat.apply", f"strategy {label!r} installed no checkpointed region on "
                f"{type(model).__name__}, so it changes nothing",
                {"blocks": shown or "none",
                 "so": "no activation is dropped or recomputed"},
                fix="check blocks= (it should select the modules the forward calls, e.g. the "
                    "layers rather than their ModuleList) and the strategy"),
        RematWarning,
        stacklevel=4,
    )


def _owner(key: str, names: list[str]) -> str | None:
    """The block ``key`` is or lies under: the longest block name that is a prefix."""
    owners = [n for n in names if key == n or key.startswith(n + ".")]
    return max(owners, key=len) if owners else None


def _resolve(named: list[tuple[str, nn.Module]], decisions: Mapping[str, BlockStrategy]
             ) -> dict[str, list[tuple[str, Sublayer]]]:
    """Per block name, the decided targets in it, ``(key, module or method)``.

    NOTE [ Decision keys ]
        A key is a block's name, or a path under a block: a module inside it
        (``"layers.3.self_attn"``) or a method sub-layer (``"layers.3._attention_forward"``,
        NOTE [ Method sub-layers ] in remat/blocks.py), found by
        :func:`~remat.blocks.sublayer_at`. So a plan's decisions on sub-layers apply with
        the same ``blocks=`` its blocks were found with. The key ``"<head>"``
        (``HEAD_KEY``) is the model's output head and loss, decided by a whole-model
        strategy such as ``chunked_head`` (NOTE [ Chunked head ] in head.py).
    """
    names = [name for name, _ in named]
    modules = dict(named)
    found: dict[str, list[tuple[str, Sublayer]]] = {}
    unknown: list[str] = []
    for key in decisions:
        if key == HEAD_KEY:
            continue
        owner = _owner(key, names)
        target = None if owner is None else modules[owner] if key == owner else \
            sublayer_at(modules[owner], key[len(owner) + 1:])
        if owner is None or target is None:
            unknown.append(key)
        else:
            found.setdefault(owner, []).append((key, target))
    if unknown:
        raise StrategyError(message(
            "remat.apply", "the plan names blocks this model does not have",
            {"plan's blocks": sorted(unknown)[:5],
             "model's blocks": f"{sorted(names)[:5]}{' ...' if len(names) > 5 else ''}",
             "a name is": "a block, or a module or method sub-layer inside one"},
            fix="apply a plan made for this model with the same blocks= setting"))
    return found


def apply_decisions(model: M, decisions: Mapping[str, BlockStrategy], *,
                    blocks: BlocksSpec = None, label: str = "plan") -> M:
    """Install one block-level strategy per decided block or sub-layer (how a Plan is
    applied).

    Keys are block names, or paths under a block: a module or a method sub-layer inside
    it (NOTE [ Decision keys ]). Blocks missing from ``decisions`` get nothing
    (``"none"``).

    Raises:
        StrategyError: a name in ``decisions`` is neither one of the model's blocks nor
            a module or method inside one, or a value is not a block-level strategy (or
            cannot be installed on the method it names).
    """
    remove(model)
    named = named_blocks(model, blocks, api="remat.apply")
    targets = _resolve(named, decisions)
    wrong = {n: d for n, d in decisions.items() if not isinstance(d, BlockStrategy)}
    if wrong:
        name, value = next(iter(wrong.items()))
        raise StrategyError(message(
            "remat.apply", f"what {name!r} gets must be a block-level strategy",
            {"found": f"{value!r} ({type(value).__name__})"},
            fix="use an instance such as remat.strategies.parse_strategy('full')"))
    _check_head_keys(decisions)
    pitfalls = check_model(model)
    regions: list[nn.Module] = []
    labels: list[tuple[str, str]] = []
    try:
        head = decisions.get(HEAD_KEY)
        if head is not None:
            regions += block_handler_of(head).install_block(head, model)
            labels.append((HEAD_KEY, head.label()))
        for name, _ in named:
            decided = targets.get(name, [])
            if not any(key == name for key, _ in decided):
                labels.append((name, "none"))
            for key, target in decided:
                decision = decisions[key]
                handler = block_handler_of(decision)
                regions += handler.install_method(decision, target) \
                    if isinstance(target, BlockMethod) else handler.install_block(decision, target)
                labels.append((key, decision.label()))
    except BaseException:
        remove(model)  # nothing half-applied
        raise
    pitfalls += check_regions(model, regions)
    warn_pitfalls(pitfalls, model_name=type(model).__name__)
    _offload_notice(model, decisions)
    if not _installed(model) and any(d.name != "none" for d in decisions.values()):
        _no_region_notice(model, label, [name for name, _ in named])
    model.__dict__[_APPLIED] = AppliedStrategy(label, tuple(labels))
    return model


def _check_head_keys(decisions: Mapping[str, BlockStrategy]) -> None:
    """A whole-model strategy is decided under ``"<head>"`` and only there."""
    for key, decision in decisions.items():
        on_head = block_handler_of(decision).on_head
        if on_head != (key == HEAD_KEY):
            raise StrategyError(message(
                "remat.apply", f"{decision.label()!r} cannot be decided for {key!r}",
                {"why": f"{decision.label()} installs on the model's output head, decided "
                        f"under {HEAD_KEY!r}" if on_head else
                        f"{HEAD_KEY!r} is the output head, decided by a whole-model "
                        "strategy such as chunked_head"},
                fix=f"decide chunked_head under {HEAD_KEY!r} and block strategies under "
                    "block names"))


def _apply_strategy(model: M, strategy: Strategy, blocks: BlocksSpec) -> M:
    named = named_blocks(model, blocks, api="remat.apply")
    try:
        handler = handler_of(strategy)
        decisions = handler.decisions(strategy, named)
    except StrategyError as exc:
        raise StrategyError(with_api("remat.apply", str(exc))) from None
    if decisions is not None:
        return apply_decisions(model, decisions, blocks=blocks, label=str(strategy))
    remove(model)
    pitfalls = check_model(model)
    regions = handler.install(strategy, named) or []
    pitfalls += check_regions(model, regions)
    warn_pitfalls(pitfalls, model_name=type(model).__name__)
    if not _installed(model):
        _no_region_notice(model, str(strategy), [name for name, _ in named])
    model.__dict__[_APPLIED] = AppliedStrategy(
        str(strategy), tuple((name, str(strategy)) for name, _ in named)
    )
    return model


def apply(model: M, strategy: str | Strategy | Any, *, blocks: BlocksSpec = None,
          on_new_shape: str | None = None, replan_with: Mapping[str, Any] | None = None) -> M:
    """Checkpoint (or offload) a model's blocks in place and return the model.

    Trades compute for memory: checkpointed regions drop their activations after
    forward and recompute them in backward (about one extra forward of the region).
    Always non-reentrant ``torch.utils.checkpoint`` with the RNG state preserved,
    so dropout draws the same masks on recompute and gradients are unchanged.
    The module tree, ``state_dict()`` keys and parameter names are untouched.
    Applying again replaces the previous strategy; :func:`remove` undoes it.

    Args:
        model: the model; its repeated blocks are found by :func:`remat.find_blocks`.
        strategy: a registered strategy (``remat.STRATEGIES``): ``"none"``, ``"full"``
            (each block), ``"every:N"`` (blocks 0, N, 2N, ...), ``"sqrt"`` (consecutive
            blocks of each stack in ~sqrt(L) segments, one region each), ``"attn"`` /
            ``"mlp"`` (only that sub-layer of each block: a module, or a method of the
            block such as ``_attention_forward``), ``"ops"`` (op-level selective
            checkpointing: keep matmul/attention/conv outputs, recompute the rest),
            ``"offload"`` (saved activations in pinned host memory; a no-op on CPU),
            ``"full_offload"`` (``full``, its inputs in pinned host memory),
            ``"chunked_head:N"`` (the output head and loss in N token slices, recomputed
            in backward; NOTE [ Chunked head ]), several joined by ``+``
            (``"full+chunked_head:8"``); a
            :class:`~remat.strategies.base.Strategy` config; or a Plan from
            :func:`remat.plan` (a plan made by ``remat.plan_compiled`` also compiles each
            block in place with the compiler budget it records).
        blocks: which modules are blocks: a class, a list of classes, or a predicate
            ``(qualified_name, module) -> bool``. Default: found automatically.
        on_new_shape: for a plan that records the shapes it was made for
            (``plan.shape_envelope``), what a training batch outside them does, checked
            before each forward (NOTE [ Shape guard ] in guard.py): ``"error"`` raises
            :class:`~remat.errors.ShapeOutsidePlan`, ``"warn"`` warns once per shape
            bucket and runs, ``"replan"`` plans for the batch's shape bucket once (same
            budget, cached, applied before the forward runs), ``"off"`` checks nothing.
            Only shapes count: a packed batch (position ids restarting inside a row) or
            a padded one (an attention mask with zeros) of the plan's shapes passes.
            Default: the plan's own ``on_new_shape`` (``"error"``).
        replan_with: keyword arguments of :func:`remat.plan` a replan uses
            (``optimizer=``, ``loss_fn=``, ...; the budget is the plan's): pass what the
            plan was made with, since a replan without the optimizer counts no optimizer
            state. Default: ``None`` (none; with ``"replan"`` a
            :class:`~remat.errors.RematWarning` says so; ``remat.auto`` passes its own).

    Returns:
        ``model``, modified in place.

    Raises:
        StrategyError: unknown strategy (the message lists the valid ones), a plan
            made for another model (the message says what differs), or ``on_new_shape``
            with a strategy (only a plan has shapes).
        BlocksNotFound: no repeated blocks found (the message says how to pass ``blocks=``).

    Example:
        >>> model = remat.models.build_model("gpt-tiny")
        >>> remat.apply(model, "every:2")  # checkpoint blocks 0, 2, 4, ...
        >>> remat.apply(model, plan, on_new_shape="replan")  # a plan per new shape bucket
    """
    if on_new_shape is not None:
        check_on_new_shape(on_new_shape, api="remat.apply")
    plan_decisions = getattr(strategy, "decisions", None)
    if plan_decisions is not None and not isinstance(strategy, (str, Strategy)):
        # A Plan (planning is a layer above): it refuses a model it was not made for.
        check = getattr(strategy, "check_model", None)
        if callable(check):
            check(model)
        plan_blocks = getattr(strategy, "blocks", None)
        # A plan's own blocks win: its decisions are keyed by the names they produce.
        chosen = plan_blocks if plan_blocks is not None else blocks
        apply_decisions(model, plan_decisions, blocks=chosen, label="plan")
        compiled = getattr(strategy, "compiled", None)
        if compiled is not None:  # a plan for compiled execution: compile as it records
            from remat.compiled.install import compile_plan

            compile_plan(model, compiled, blocks=chosen)
            for module in model.modules():  # remove() uncompiles what the plan compiled
                if getattr(module, "_compiled_call_impl", None) is not None:
                    module.__dict__[_COMPILED_BY_PLAN] = True
        mode = on_new_shape or str(getattr(strategy, "on_new_shape", "error"))
        if getattr(strategy, "shape_envelope", None) is not None and mode != "off" \
                and compiled is None:  # NOTE [ Shape guard ]
            if mode == "replan" and replan_with is None:
                warnings.warn(message(
                    "remat.apply", "on_new_shape='replan' without replan_with=",
                    {"why": "a replan measures a step with the loss and optimizer it is "
                            "given; without yours it counts no optimizer state, and its "
                            "plan can run over the budget in your loop"},
                    fix="pass replan_with={'optimizer': optimizer, 'loss_fn': ...} (what "
                        "the plan was made with), or {} if it was made with neither"),
                    RematWarning, stacklevel=2)
            install_guard(model, ShapeGuard(model, strategy, on_new_shape=mode,
                                            switch=_switch_plan, blocks=chosen,
                                            replan_with=replan_with))
        return model
    if on_new_shape not in (None, "off"):
        raise StrategyError(message(
            "remat.apply", f"on_new_shape={on_new_shape!r} needs a plan",
            {"strategy": repr(strategy), "why": "a plan records the shapes it was made for; "
                                                 "a strategy has none"},
            fix="apply a plan from remat.plan, or drop on_new_shape"))
    return _apply_strategy(model, parse_strategy(strategy, api="remat.apply"), blocks)


def _switch_plan(model: nn.Module, plan: Any, blocks: BlocksSpec) -> None:
    """The shape guard's switch: ``plan``'s decisions on ``model`` (``None``: remove
    everything, the guard included; NOTE [ Replanning from the guard ])."""
    if plan is None:
        remove(model)
    else:
        apply_decisions(model, plan.decisions, blocks=blocks, label="plan")


@contextmanager
def preserved_strategy(model: nn.Module) -> Iterator[None]:
    """Put back whatever strategy was applied to ``model`` on exit.

    For code that applies strategies to try them (the planner, the frontier) on a
    model its user may already have checkpointed.

    Example:
        >>> with preserved_strategy(model):
        ...     apply(model, "full")
        ...     prof = remat.profile(model, batch)
    """
    installed = [(m, {**installed_attributes(m), **head_attributes(m),
                      **({_APPLIED: m.__dict__[_APPLIED]} if _APPLIED in m.__dict__ else {})})
                 for m in model.modules()]
    guard = shape_guard(model)
    try:
        yield
    finally:
        remove(model)
        for module, saved in installed:
            module.__dict__.update(saved)
        if guard is not None:
            install_guard(model, guard)


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """Silence warnings while remat applies candidates to a model it measures (the
    pitfall notices ``apply`` gives a user are noise for a copy or a trial)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextmanager
def trial(model: M, decisions: Mapping[str, BlockStrategy] | str | Strategy | None = None,
          *, blocks: BlocksSpec = None, label: str = "plan", quiet: bool = True,
          within: AbstractContextManager[Any] | None = None) -> Iterator[M]:
    """Try a strategy on ``model`` and put back what was applied before, on exit.

    The one apply / measure / restore pattern of the planner, the frontier and every
    other caller that measures a strategy on a model its user may already have
    checkpointed: :func:`preserved_strategy`, then (with ``quiet``) warnings silenced
    (:func:`quiet_warnings`), then ``within`` entered (a fake-tensor mode,
    the model's preserved state), then ``decisions`` applied, in that order; undone in
    reverse. A failure while applying restores the model too.

    Args:
        model: the model (changed in place inside the block, restored after).
        decisions: per module name, its block-level config (applied as a plan is, with
            :func:`apply_decisions`); a strategy string or config (applied with
            :func:`apply`); or ``None``: nothing applied (the caller applies inside).
            Default: ``None``.
        blocks: which modules are blocks (as :func:`apply` takes it). Default: found.
        label: what :func:`applied` reports for ``decisions`` given per module.
            Default: ``"plan"``.
        quiet: silence warnings while the strategy is tried (the notices ``apply`` gives
            the user are not the caller's). Default: ``True``.
        within: a context entered after the warnings are silenced and before applying
            (``FakeSetup.mode``, ``preserved_state(...)``). Default: ``None``.

    Example:
        >>> with trial(model, {"layers.0": Full()}) as tried:
        ...     prof = remat.profile(tried, batch)
    """
    with preserved_strategy(model), (quiet_warnings() if quiet else nullcontext()), \
            (within if within is not None else nullcontext()):
        if isinstance(decisions, Mapping):
            apply_decisions(model, decisions, blocks=blocks, label=label)
        elif decisions is not None:
            apply(model, decisions, blocks=blocks)
        yield model
