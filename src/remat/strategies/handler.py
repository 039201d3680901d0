"""What a strategy does: a handler per config type (the behaviour apart from the config).

A strategy's config (:class:`~remat.strategies.base.Strategy`) is plain data; its
handler, registered per config type with :func:`remat.register_strategy` (as torchao's
``register_quantize_module_handler`` does), says

- how it is written (:attr:`Handler.argument`, :meth:`Handler.parse`,
  :meth:`Handler.spelling`, :attr:`Handler.summary`),
- which strategy each block gets (:meth:`Handler.decisions`) or, for strategies whose
  regions span blocks, how it installs on the model (:meth:`Handler.install`),
- which of its configs belong in ``remat compare``, ``remat simulate`` and the
  frontier's manual points (:attr:`Handler.purposes`, :meth:`Handler.examples`),
- which candidates it offers the planner (:meth:`Handler.offers`),

and, for block-level strategies (:class:`BlockHandler`), how a config installs on one
module (:meth:`BlockHandler.install_block`) and the flags the planner reads
(``moves_to_host``, ...). ``remat.apply``, the planner and the CLI look a config's
handler up with :func:`handler_of`.

Example::

    >>> from remat.strategies.builtin import Full
    >>> handler_of(Full()).spelling()
    'full'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

from torch import nn

from remat.blocks import BlockMethod
from remat.errors import StrategyError, message
from remat.strategies.base import BlockContext, BlockStrategy, Offer, Purpose, Strategy

C = TypeVar("C", bound=Strategy)
B = TypeVar("B", bound=BlockStrategy)


class Handler(Generic[C]):
    """The behaviour of a whole-model strategy whose config is ``C``.

    Subclass it (or :class:`BlockHandler`), override what the strategy does, and register
    it for its config type with :func:`remat.register_strategy`; remat makes one instance
    and sets :attr:`config` to the config type.

    Class attributes:
        summary: one line for help texts.
        argument: the argument's placeholder (``"N"`` for ``every:N``), or ``None``.
        purposes: where the strategy's :meth:`examples` are listed by default
            (``"compare"``, ``"simulate"``, ``"frontier"``).
        spans_blocks: its regions span several blocks, so they cannot be compiled or
            sharded block by block (``sqrt``).
    """

    summary: ClassVar[str] = ""
    argument: ClassVar[str | None] = None
    purposes: ClassVar[frozenset[str]] = frozenset({"compare", "simulate", "frontier"})
    spans_blocks: ClassVar[bool] = False

    config: type[C]
    """The config type this handler is registered for (set at registration)."""

    @property
    def name(self) -> str:
        """The config's registered name (``"every"``)."""
        return self.config.name

    def parse(self, argument: str | None) -> C:
        """The config for ``name`` (``argument`` is ``None``) or ``name:argument``.

        Raises:
            StrategyError: the argument is missing, unexpected or unreadable. The message
                (``remat.errors.message("", ...)``) names no call:
                :func:`~remat.strategies.registry.parse_strategy` adds its caller's.
        """
        if argument is not None:
            raise StrategyError(message(
                "", f"strategy {self.name!r} takes no argument",
                {"found": f"{self.name}:{argument}"}, fix=f"write {self.name!r} alone"))
        return self.config()

    def spelling(self) -> str:
        """How the strategy is written in help texts: ``"full"``, ``"every:N"``."""
        return f"{self.name}:{self.argument}" if self.argument else self.name

    def examples(self, num_blocks: int, purpose: Purpose) -> list[Strategy]:
        """Configs shown by default for ``purpose`` on a model of ``num_blocks`` blocks."""
        return [self.parse(None)] if purpose in self.purposes else []

    def decisions(self, config: C, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy] | None:
        """What each module gets: qualified name (a block, or a module inside one) ->
        block-level config; modules left out get nothing. ``None`` when the strategy is
        not per block (it then overrides :meth:`install`). Default: ``None``.

        Args:
            config: the strategy's config.
            blocks: the model's blocks, ``(qualified name, module)``, in model order.
        """
        return None

    def install(self, config: C, blocks: Sequence[tuple[str, nn.Module]]
                ) -> list[nn.Module] | None:
        """Install on the model's blocks itself; return the modules made regions.

        Default: ``None``, meaning "install :meth:`decisions` block by block" (what every
        per-block strategy wants). Strategies whose regions span blocks override it.
        """
        return None

    def offers(self, config: C, context: BlockContext) -> list[Offer]:
        """Candidates for the planner on a kind of block. Default: none."""
        return []


class BlockHandler(Handler[B]):
    """The behaviour of a block-level strategy (config ``B``): installed on one module.

    Class attributes:
        moves_to_host: it costs host transfers rather than recompute (``offload``), or
            besides recompute (``full_offload``).
        offloads_inputs: it checkpoints like ``full`` and moves only what ``full`` keeps
            (the region's inputs), copied back one region ahead (``full_offload``): the
            planner prices its transfers against ``full``'s saved bytes.
        without_host: what it amounts to on a model with no separate host memory (the
            CPU), for the notice :func:`remat.apply` gives there. Default: ``""``.
        on_head: it installs on the whole model's output head and loss, decided under the
            key ``"<head>"`` rather than per block (``chunked_head``).
    """

    moves_to_host: ClassVar[bool] = False
    offloads_inputs: ClassVar[bool] = False
    without_host: ClassVar[str] = ""
    on_head: ClassVar[bool] = False

    def decisions(self, config: B, blocks: Sequence[tuple[str, nn.Module]]
                  ) -> dict[str, BlockStrategy] | None:
        """Every block gets ``config``."""
        return {name: config for name, _ in blocks}

    def install_block(self, config: B, block: nn.Module) -> list[nn.Module]:
        """Install ``config`` on ``block`` (a block, or a module inside one); return the
        modules made regions. Every block-level handler overrides it.

        Raises:
            StrategyError: the handler does not override it.
        """
        raise StrategyError(message(
            "remat.apply", f"{type(self).__name__} does not say how {config.label()!r} "
            "installs on a module", {"config": type(config).__name__},
            fix=f"override install_block(config, block) in {type(self).__name__}"))

    def install_method(self, config: B, method: BlockMethod) -> list[nn.Module]:
        """Install ``config`` on a sub-layer written as a method (a decision keyed
        ``"layers.3._attention_forward"``; NOTE [ Method regions ] in regions.py); return
        the modules holding regions.

        Default: refused; ``full``, ``ops`` and ``offload`` override it.

        Raises:
            StrategyError: the strategy installs on modules only.
        """
        raise StrategyError(message(
            "remat.apply", f"strategy {config.label()!r} cannot be installed on a method",
            {"method": f"{type(method.owner).__name__}.{method.name}",
             "why": f"{type(config).__name__} installs on modules only (install_block)"},
            fix="decide on the method with full, ops or offload, or decide on the block"))


_HANDLERS: dict[type[Strategy], Handler[Any]] = {}


def add_handler(config: type[Strategy], handler: Handler[Any]) -> None:
    """Record ``handler`` as the behaviour of ``config`` (what the registry does once it
    has checked the name); replaces an earlier handler of the same config type."""
    handler.config = config
    _HANDLERS[config] = handler


def drop_handler(config: type[Strategy]) -> None:
    """Forget ``config``'s handler (what ``unregister_strategy`` does)."""
    _HANDLERS.pop(config, None)


def handler_of(config: Strategy | type[Strategy]) -> Handler[Any]:
    """The handler registered for ``config``'s type (a config instance or type), else for
    the nearest base class that has one: a config derived from ``Full`` without a handler
    of its own installs as ``full`` does.

    Raises:
        StrategyError: no handler is registered for that type or any of its bases.

    Example:
        >>> every = EveryN(3)
        >>> handler_of(every).decisions(every, named_blocks(model))  # a 4-block model
        {'layers.0': Full(), 'layers.3': Full()}
    """
    kind = config if isinstance(config, type) else type(config)
    handler = next((_HANDLERS[c] for c in kind.__mro__ if c in _HANDLERS), None)
    if handler is None:
        raise StrategyError(message(
            "remat.apply", f"no handler is registered for {kind.__name__}",
            {"config": f"{kind.__module__}.{kind.__qualname__}"},
            fix="register it with @remat.register_strategy(" + kind.__name__ +
                ") on its handler class (docs/extending.md)"))
    return handler


def block_handler_of(config: BlockStrategy | type[BlockStrategy]) -> BlockHandler[Any]:
    """:func:`handler_of` for a block-level config, typed as a :class:`BlockHandler`.

    Raises:
        StrategyError: no handler, or one that is not a block handler.
    """
    handler = handler_of(config)
    if not isinstance(handler, BlockHandler):
        kind = config if isinstance(config, type) else type(config)
        raise StrategyError(message(
            "remat.apply", f"the handler of {kind.__name__} is not a BlockHandler",
            {"handler": type(handler).__name__},
            fix="derive the handler of a BlockStrategy config from remat.BlockHandler"))
    return handler
