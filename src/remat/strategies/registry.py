"""The strategy registry: every strategy remat knows, by name, in one place.

Every list of strategies in remat comes from here: the public ``remat.STRATEGIES``,
``remat compare``'s and ``remat simulate``'s default rows, the frontier's manual
points, the CLI's help, the planner's candidates (each block-level strategy's
:meth:`~remat.strategies.base.BlockStrategy.offers`) and the kinds a Plan may hold.
Strategy strings (``"every:2"``) parse here.

Example::

    >>> from remat.strategies.registry import parse_strategy, default_strategies
    >>> str(parse_strategy("every:3"))
    'every:3'
    >>> default_strategies("compare", num_blocks=4)[:3]
    ['none', 'full', 'every:2']
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Iterator, Sequence
from typing import TypeVar, cast, overload

from remat.errors import RematWarning, StrategyError
from remat.strategies.base import BlockStrategy, Purpose, Strategy
from remat.strategies.builtin import BUILTIN
from remat.strategies.decision import BlockDecision

__all__ = [
    "ENTRY_POINT_GROUP",
    "STRATEGIES",
    "block_strategy",
    "check_decision",
    "default_strategies",
    "load_entry_points",
    "parse_strategy",
    "register_strategy",
    "registered",
    "unregister_strategy",
]

S = TypeVar("S", bound=type[Strategy])

#: Installed packages register strategies under this entry-point group, e.g. in their
#: pyproject.toml: ``[project.entry-points."remat.strategies"] halves = "pkg.mod:Halves"``;
#: the ``remat`` command line then knows them too.
ENTRY_POINT_GROUP = "remat.strategies"

_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: S) -> S:
    """Register a strategy class under its ``name`` (use as a class decorator).

    Once registered, the strategy parses from strings (``remat.apply(model, "name")``),
    appears in ``remat compare``'s and ``remat simulate``'s default rows and the
    frontier (per its ``purposes``), and, when it is a :class:`BlockStrategy`, its
    offers become planner candidates and plans may hold its decisions.

    Raises:
        StrategyError: not a Strategy subclass, a bad name, or a name already taken by
            another class (call :func:`unregister_strategy` first to replace it).

    Example:
        >>> @remat.register_strategy
        ... @dataclass(frozen=True)
        ... class Twice(Full):
        ...     name: ClassVar[str] = "twice"
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise StrategyError(f"register_strategy: expected a Strategy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum() \
            or name.lower() != name:
        raise StrategyError(f"register_strategy: {cls.__name__}.name must be a lower-case "
                            f"word such as 'full', got {name!r}")
    known = _REGISTRY.get(name)
    if known is not None and known is not cls:
        raise StrategyError(
            f"register_strategy: the name {name!r} is taken by {known.__module__}."
            f"{known.__qualname__}; pick another name or unregister_strategy({name!r}) first"
        )
    _REGISTRY[name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (built-in ones cannot be removed).

    Raises:
        StrategyError: unknown name, or a built-in strategy.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise StrategyError(f"unregister_strategy: no strategy named {name!r}")
    if cls in BUILTIN:
        raise StrategyError(f"unregister_strategy: {name!r} is built in and stays registered")
    del _REGISTRY[name]


def registered() -> tuple[type[Strategy], ...]:
    """Every registered strategy class, built-in ones first, in registration order."""
    return tuple(_REGISTRY.values())


class _Names(Sequence[str]):
    """The registered strategies as written (``"every:N"``), read live from the registry."""

    def _names(self) -> tuple[str, ...]:
        return tuple(cls.spelling() for cls in _REGISTRY.values())

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


def parse_strategy(strategy: str | Strategy) -> Strategy:
    """Parse ``"full"``, ``"every:3"``, ... into the registered strategy's config.

    Raises:
        StrategyError: not a string, an unknown name or a bad argument; the message lists
            the valid strategies.

    Example:
        >>> parse_strategy("every:3")
        EveryN(n=3)
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise StrategyError(
            f"remat.apply: strategy must be a string or a Plan (or a Strategy config), got "
            f"{type(strategy).__name__}. Valid strategies: {_valid()}"
        )
    text = strategy.strip().lower()
    name, sep, argument = text.partition(":")
    cls = _REGISTRY.get(name.strip())
    if cls is None:
        raise StrategyError(
            f"remat.apply: unknown strategy {strategy!r}. Valid strategies: {_valid()}"
        )
    return cls.parse(argument.strip() if sep else None)


def block_strategy(kind: str) -> BlockStrategy:
    """The block-level strategy a decision of ``kind`` installs with.

    Raises:
        StrategyError: ``kind`` is not registered, or not a per-block strategy.
    """
    cls = _REGISTRY.get(kind)
    if cls is None or not issubclass(cls, BlockStrategy):
        kinds = ", ".join(c.name for c in _REGISTRY.values() if issubclass(c, BlockStrategy))
        raise StrategyError(
            f"remat.apply: {kind!r} is not a per-block decision kind; known kinds: {kinds}. "
            "Is the strategy that defines it registered (remat.register_strategy)?"
        )
    return cast(BlockStrategy, cls.parse(None))


def check_decision(decision: BlockDecision) -> BlockStrategy:
    """The strategy of ``decision``, after checking its kind and save set.

    Raises:
        StrategyError: unknown kind, or a save set on a kind that takes none.
    """
    strategy = block_strategy(decision.kind)
    if decision.save_ops is not None and not strategy.takes_save_ops:
        raise StrategyError(
            f"remat.apply: decision {decision.label()!r}: save_ops is only meaningful for "
            f"kinds that keep chosen ops (e.g. 'ops'), not {decision.kind!r}"
        )
    return strategy


def default_strategies(purpose: Purpose, *, num_blocks: int = 2) -> list[str]:
    """The strategies shown by default for ``purpose``, as strings, baseline first.

    Args:
        purpose: ``"compare"`` (``remat compare``'s rows), ``"simulate"`` (``remat
            simulate``'s) or ``"frontier"`` (the manual points beside a plan).
        num_blocks: the model's number of blocks (``every:2 .. every:L`` on the frontier).
            Default: 2.
    """
    return [str(s) for cls in _REGISTRY.values() for s in cls.examples(num_blocks, purpose)]


def load_entry_points() -> list[str]:
    """Register the strategies installed packages declare (:data:`ENTRY_POINT_GROUP`).

    A plug-in that fails to load is skipped with a :class:`~remat.errors.RematWarning`
    naming it. Returns the names registered.
    """
    names: list[str] = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = entry.load()
            register_strategy(cls)
        except Exception as exc:  # noqa: BLE001  (a broken plug-in must not break remat)
            warnings.warn(f"remat: could not register strategy plug-in {entry.name!r} "
                          f"({entry.value}): {type(exc).__name__}: {exc}", RematWarning,
                          stacklevel=2)
            continue
        names.append(cls.name)
    return names


for _cls in BUILTIN:
    register_strategy(_cls)
load_entry_points()
