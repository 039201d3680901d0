"""The strategy registry: every strategy remat knows, by name, with its handler.

Every list of strategies in remat comes from here: the public ``remat.STRATEGIES``,
``remat compare``'s and ``remat simulate``'s default rows, the frontier's manual
points, the CLI's help, the planner's candidates (each block-level strategy's
:meth:`~remat.strategies.handler.Handler.offers`) and the kinds a Plan may hold. Each
name maps to a config type (:class:`~remat.strategies.base.Strategy`), and each config
type to its handler (:mod:`remat.strategies.handler`). Strategy strings (``"every:2"``)
parse here.

Example::

    >>> from remat.strategies.registry import parse_strategy, default_strategies
    >>> str(parse_strategy("every:3"))
    'every:3'
    >>> default_strategies("compare", num_blocks=4)[:3]
    ['none', 'full', 'every:2']
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

from remat.errors import RematWarning, StrategyError, message, with_api
from remat.strategies.base import BlockStrategy, Purpose, Strategy
from remat.strategies.builtin import BUILTIN, BUILTIN_HANDLERS
from remat.strategies.combined import Combined, CombinedHandler
from remat.strategies.handler import (
    BlockHandler,
    Handler,
    add_handler,
    drop_handler,
    handler_of,
)

H = TypeVar("H", bound=type[Handler[Any]])

#: Installed packages register strategies under this entry-point group, naming the config
#: type, whose module registers it on import, e.g. in their pyproject.toml:
#: ``[project.entry-points."remat.strategies"] halves = "pkg.mod:Halves"``; the ``remat``
#: command line then knows them too.
ENTRY_POINT_GROUP = "remat.strategies"

_REGISTRY: dict[str, type[Strategy]] = {}

#: What a handler does and a config must not carry (a config is plain data).
_BEHAVIOUR = ("install", "install_block", "install_method", "decisions", "offers", "parse",
              "spelling", "examples")


@overload
def register_strategy(config: type[Strategy]) -> Callable[[H], H]: ...
@overload
def register_strategy(config: type[Strategy], handler: H) -> H: ...


def register_strategy(config: type[Strategy], handler: H | None = None
                      ) -> H | Callable[[H], H]:
    """Register a strategy: its config type under its ``name``, with its handler class.

    Used as a decorator on the handler, as torchao registers a handler per config type:
    ``@remat.register_strategy(MyConfig)`` above ``class MyHandler(remat.BlockHandler)``;
    or called with both. Once registered, the strategy parses from strings
    (``remat.apply(model, "name")``), appears in ``remat compare``'s and ``remat
    simulate``'s default rows and the frontier (per its handler's ``purposes``), and, when
    it is a :class:`~remat.strategies.base.BlockStrategy`, its handler's offers become
    planner candidates and plans may hold its configs.

    Args:
        config: the config type, a frozen dataclass deriving from ``remat.Strategy`` (or
            ``remat.BlockStrategy``) with a ``name``.
        handler: its handler class (a ``remat.strategies.Handler`` subclass; a
            ``BlockHandler`` for a block-level config). Default: ``None`` (return a
            decorator taking it).

    Raises:
        StrategyError: not a Strategy subclass or a Handler subclass, a block-level config
            without a BlockHandler (or the reverse), a bad name, or a name already taken
            by another config (call :func:`unregister_strategy` first to replace it).

    Example:
        >>> @dataclass(frozen=True)
        ... class Twice(remat.BlockStrategy):
        ...     name: ClassVar[str] = "twice"
        >>> @remat.register_strategy(Twice)
        ... class TwiceHandler(remat.BlockHandler[Twice]):
        ...     def install_block(self, config, block): ...
    """
    cls = config
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise StrategyError(message("register_strategy", "expected a Strategy subclass",
                                    {"found": repr(cls)},
                                    fix="pass the config type, a subclass of remat.Strategy"))
    behaviour = [m for m in _BEHAVIOUR if hasattr(cls, m)]
    if behaviour:  # a class written before configs and handlers were apart
        raise StrategyError(message(
            "register_strategy", f"{cls.__name__} carries behaviour; a config is data only",
            {"methods": ", ".join(behaviour)},
            fix=f"move them to a handler: @remat.register_strategy({cls.__name__}) on "
                f"class {cls.__name__}Handler(remat.BlockHandler), each method taking the "
                "config (docs/extending.md)"))
    if handler is None:
        def decorate(handler_cls: H) -> H:
            return register_strategy(cls, handler_cls)
        return decorate
    if not (isinstance(handler, type) and issubclass(handler, Handler)):
        raise StrategyError(message(
            "register_strategy", f"the handler of {cls.__name__} must be a Handler subclass",
            {"found": repr(handler)},
            fix="decorate a subclass of remat.strategies.Handler (or BlockHandler)"))
    if issubclass(cls, BlockStrategy) != issubclass(handler, BlockHandler):
        raise StrategyError(message(
            "register_strategy", f"{cls.__name__} and {handler.__name__} do not match",
            {"config": "block-level" if issubclass(cls, BlockStrategy) else "whole-model",
             "handler": "block-level" if issubclass(handler, BlockHandler) else "whole-model"},
            fix="a BlockStrategy config takes a BlockHandler, a Strategy config a Handler"))
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum() \
            or name.lower() != name:
        raise StrategyError(message("register_strategy",
                                    f"{cls.__name__}.name must be a lower-case word",
                                    {"found": repr(name)},
                                    fix="name it with a lower-case word such as 'full'"))
    known = _REGISTRY.get(name)
    if known is not None and known is not cls:
        raise StrategyError(message(
            "register_strategy", f"the name {name!r} is taken",
            {"taken by": f"{known.__module__}.{known.__qualname__}"},
            fix=f"pick another name or unregister_strategy({name!r}) first"))
    _REGISTRY[name] = cls
    add_handler(cls, handler())
    return handler


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (built-in ones cannot be removed).

    Raises:
        StrategyError: unknown name, or a built-in strategy.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise StrategyError(message("unregister_strategy", f"no strategy named {name!r}",
                                    {"registered": _valid()},
                                    fix="pass the name of a registered strategy"))
    if cls in BUILTIN:
        raise StrategyError(message("unregister_strategy",
                                    f"{name!r} is built in and stays registered",
                                    fix="register your strategy under another name"))
    del _REGISTRY[name]
    drop_handler(cls)


def registered() -> tuple[type[Strategy], ...]:
    """Every registered config type, built-in ones first, in registration order (each
    one's handler: :func:`~remat.strategies.handler.handler_of`)."""
    return tuple(_REGISTRY.values())


class _Names(Sequence[str]):
    """The registered strategies as written (``"every:N"``), read live from the registry."""

    def _names(self) -> tuple[str, ...]:
        return tuple(handler_of(cls).spelling() for cls in _REGISTRY.values())

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


#: The strategy names :func:`remat.apply` accepts (``every:N`` takes an integer N >= 1);
#: a live view: strategies registered later appear in it.
STRATEGIES: Sequence[str] = _Names()


def _valid() -> str:
    return ", ".join(STRATEGIES)


def parse_strategy(strategy: str | Strategy, *,
                   api: str = "remat.strategies.parse_strategy") -> Strategy:
    """Parse ``"full"``, ``"every:3"``, ... into the registered strategy's config.

    Args:
        strategy: the strategy string (or a Strategy config, returned as is).
        api: the call the user made (``"remat.apply"``, ``"remat.validate"``, ...),
            named on the first line of the error message.

    Raises:
        StrategyError: not a string, an unknown name or a bad argument; the message lists
            the valid strategies.

    Several strategies joined by ``+`` (``"full+chunked_head:8"``) parse to a
    :class:`~remat.strategies.combined.Combined` of them.

    Example:
        >>> parse_strategy("every:3")
        EveryN(n=3)
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise StrategyError(message(
            api, "strategy must be a string or a Plan (or a Strategy config)",
            {"found": type(strategy).__name__, "valid strategies": _valid()},
            fix="pass one of the valid strategies, a Plan from remat.plan or a Strategy"))
    text = strategy.strip()
    if "+" in text:  # several at once: "full+chunked_head:8"
        return Combined(tuple(parse_strategy(part, api=api) for part in text.split("+")))
    call = _LABEL.fullmatch(text)
    if call is not None and call.group(1).lower() in _REGISTRY:  # a label: name(field=value)
        return _from_label(_REGISTRY[call.group(1).lower()], call.group(2), strategy, api)
    text = text.lower()
    name, sep, argument = text.partition(":")
    cls = _REGISTRY.get(name.strip())
    if cls is None:
        raise StrategyError(message(
            api, f"unknown strategy {strategy!r}", {"valid strategies": _valid()},
            fix="pass one of the valid strategies (or register yours with "
                "remat.register_strategy)"))
    try:
        parsed: Strategy = handler_of(cls).parse(argument.strip() if sep else None)
        return parsed
    except StrategyError as exc:
        raise StrategyError(with_api(api, str(exc))) from None


#: ``name(field=value, ...)``: how :meth:`BlockStrategy.label` writes an instance whose
#: fields differ from their defaults; :func:`parse_strategy` reads it back.
_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\((.*)\)", re.S)


def _from_label(cls: type[Strategy], arguments: str, text: str, api: str) -> Strategy:
    """``cls(**fields)`` from the ``field=value, ...`` of a label (values are literals)."""
    try:
        call = ast.parse(f"f({arguments})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError("fields are written field=value")
        fields = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        return cls(**fields)
    except (SyntaxError, ValueError, TypeError) as exc:
        raise StrategyError(message(
            api, f"cannot read {text!r}", {"error": exc},
            fix=f"write {cls.name}(field=value, ...) with the fields of {cls.__name__} and "
                "literal values, as its label shows")) from None


def strategy_to_dict(strategy: BlockStrategy) -> dict[str, Any]:
    """A block-level strategy as JSON: ``{"name": "ops", "fields": {"save_ops": [...]}}``
    (only the fields that differ from their defaults)."""
    return {"name": strategy.name, "fields": strategy.fields_dict()}


def strategy_from_dict(data: Any, *, where: str, api: str) -> BlockStrategy:
    """The block-level strategy a plan file holds for ``where``.

    Reads ``{"name": ..., "fields": {...}}`` and the form remat 0.1 wrote,
    ``{"kind": ..., "save_ops": [...] | null}`` (or a bare name).

    Raises:
        ValueError: not one of those forms, an unknown or unregistered name, or fields the
            strategy does not take or refuses (the message names the entry and the fix).
    """
    if isinstance(data, str):
        data = {"name": data}
    if isinstance(data, Mapping) and "kind" in data and "name" not in data:  # remat 0.1
        save_ops = data.get("save_ops")
        if isinstance(save_ops, str):
            raise ValueError(message(api, f"save_ops of the decision for {where} is a string",
                                     {"found": repr(save_ops)},
                                     fix=f"write a list of op names: [{save_ops!r}]"))
        data = {"name": data["kind"],
                "fields": {} if save_ops is None else {"save_ops": save_ops}}
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise ValueError(message(api, f"the decision for {where} is not a strategy",
                                 {"found": repr(data)},
                                 fix='write {"name": "full", "fields": {}} (see Plan.to_json)'))
    name, values = data["name"], data.get("fields") or {}
    cls = _REGISTRY.get(name)
    if cls is None or not issubclass(cls, BlockStrategy):
        kinds = ", ".join(c.name for c in _REGISTRY.values() if issubclass(c, BlockStrategy))
        raise ValueError(message(
            api, f"the decision for {where} names strategy {name!r}, which is not a "
            "registered block-level strategy", {"known": kinds},
            fix="register the strategy that defines it (remat.register_strategy) before "
                "loading the plan"))
    if not isinstance(values, Mapping):
        raise ValueError(message(api, f"the fields of the decision for {where} must be an "
                                 "object", {"found": repr(values)},
                                 fix='write "fields": {"name": value, ...}'))
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        error, sep, fix = str(exc).rpartition("\n  fix: ")  # the strategy's own fix, if any
        if not sep:
            error, fix = str(exc), f"write fields {cls.__name__} accepts"
        raise ValueError(message(api, f"the decision for {where} ({name}) cannot be rebuilt",
                                 {"fields": repr(dict(values)), "error": error},
                                 fix=fix)) from None


def default_strategies(purpose: Purpose, *, num_blocks: int = 2) -> list[str]:
    """The strategies shown by default for ``purpose``, as strings, baseline first.

    Args:
        purpose: ``"compare"`` (``remat compare``'s rows), ``"simulate"`` (``remat
            simulate``'s) or ``"frontier"`` (the manual points beside a plan).
        num_blocks: the model's number of blocks (``every:2 .. every:L`` on the frontier).
            Default: 2.
    """
    return [str(s) for cls in _REGISTRY.values()
            for s in handler_of(cls).examples(num_blocks, purpose)]


def load_entry_points() -> list[str]:
    """Register the strategies installed packages declare (:data:`ENTRY_POINT_GROUP`).

    Each entry point names a config type; loading it imports its module, which registers
    the config with its handler (:func:`register_strategy`). A plug-in that fails to load,
    or whose config is not registered once loaded, is skipped with a
    :class:`~remat.errors.RematWarning` naming it. Returns the names registered.
    """
    names: list[str] = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded: Any = entry.load()
            name = getattr(loaded, "name", "")
            if not (isinstance(loaded, type) and _REGISTRY.get(name) is loaded):
                raise StrategyError(message(
                    "remat", f"{entry.value} is not a registered strategy config",
                    fix="register the config with @remat.register_strategy(Config) on its "
                        "handler, in the module the entry point names"))
        except Exception as exc:  # noqa: BLE001  (a broken plug-in must not break remat)
            warnings.warn(message("remat", f"could not register strategy plug-in "
                                  f"{entry.name!r}", {"entry point": entry.value,
                                                      "error": f"{type(exc).__name__}: {exc}"},
                                  fix="fix or uninstall the package that declares it"),
                          RematWarning, stacklevel=2)
            continue
        names.append(name)
    return names


for _config, _handler in BUILTIN_HANDLERS:
    register_strategy(_config, _handler)
add_handler(Combined, CombinedHandler())  # not named: written a+b
load_entry_points()
