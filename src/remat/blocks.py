"""Find the repeated blocks of a model, and the attention / MLP sub-layers inside a block.

Every remat API that takes a model accepts ``blocks=`` (a :data:`BlocksSpec`) and resolves it
here, so the rules below are the single definition of "a block".

# NOTE [ Default block detection ]
Rule 1: candidates are groups of >= 2 modules of the same class held by one container
        (``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``), or the single member of
        a one-element ``nn.ModuleList`` (a one-layer model's stack). A container whose members
        are all one class gives one candidate; a mixed ``nn.Sequential(emb, blk, blk, head)``
        gives one per repeated class. Members that are themselves ``ModuleList``/``ModuleDict``
        (not callable) never count; their contents are containers of their own.
        The container's first member joins the group of the class repeated right after it
        when it is another class of the same shape: its ``forward`` takes the same parameters
        and it has every kind of child the repeated members have (wav2vec2's convolutional
        feature encoder: a ``GroupNormConvLayer`` with a norm the others lack, then
        ``NoLayerNormConvLayer`` x6). A stack's first layer often differs so (it takes the
        input's channels, or normalizes the raw input), and it holds activations like the rest.
Rule 2: a candidate's size is the number of distinct parameter elements its members hold.
        Candidates holding no parameters never qualify.
Rule 3: candidates are taken greedily, largest first (outer container first on ties), and a
        candidate is kept when none of its members contains, or is contained in, an already
        kept block, and it holds >= 10% of the largest one's parameters or its members are
        layers (modules with children of their own, not a bare ``Linear``). This selects the
        two stacks of an encoder-decoder (T5: ``encoder.block`` and ``decoder.block``) and
        every tower beside them however few parameters it holds (a speech model's
        convolutional feature encoder: 5% of wav2vec2-base's parameters, most of its
        activations), and never the sub-layers of a block (e.g. ``T5Block.layer``: inside a
        kept block) nor a stray pair of Linears.
Rule 4: blocks are returned in module registration order (``named_modules``), the proxy for
        forward order used throughout remat.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from torch import nn

from remat.errors import BlocksNotFound, message

__all__ = [
    "BlockMethod",
    "BlocksSpec",
    "NamedBlocks",
    "Sublayer",
    "block_methods",
    "find_blocks",
    "find_sublayer",
    "named_blocks",
    "sublayer_at",
]

BlocksSpec: TypeAlias = (
    type[nn.Module] | Sequence[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
)
"""What ``blocks=`` accepts: a block class, several classes, a predicate
``(qualified_name, module) -> bool``, or None for automatic detection."""

@dataclass(frozen=True)
class NamedBlocks:
    """A ``blocks=`` predicate selecting modules by qualified name.

    Args:
        names: qualified module names, e.g. ``("encoder.layer.0", "encoder.layer.1")``.

    Example:
        >>> NamedBlocks(("blocks.0",))("blocks.0", None)
        True
    """

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError(message("NamedBlocks", "names must not be empty",
                                     fix="pass the qualified names of the blocks"))
        object.__setattr__(self, "names", tuple(self.names))

    def __call__(self, name: str, module: nn.Module | None) -> bool:
        return name in self.names


_MIN_SHARE = 0.10  # See Rule 3.
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_BLOCKS_HINT = (
    "pass blocks=YourBlockClass (e.g. blocks=LlamaDecoderLayer), a tuple of classes, or "
    "blocks=lambda name, module: ... selecting the repeated layers"
)


def named_blocks(
    model: nn.Module, blocks: BlocksSpec = None, *, api: str = "remat.find_blocks"
) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` as ``(qualified_name, module)``, in forward order.

    Checkpointing granularity is a trade-off: whole blocks are the natural unit (one saved
    input per block), so remat finds them once here and every strategy works on this list.

    Args:
        model: any ``nn.Module``.
        blocks: None to detect the blocks (see NOTE [ Default block detection ] in this
            module); a class or a sequence of classes (``isinstance``); or a predicate
            ``(qualified_name, module) -> bool``. Explicit specs return only outermost matches:
            a match nested in another match is skipped. A matched ``ModuleList`` or
            ``ModuleDict`` (never called itself) stands for its members, and so does a
            matched ``nn.Sequential`` whose members the spec matches too (NOTE
            [ Containers in a blocks spec ]). The root module is never a block.
            Default: None.
        api: name of the public API to prefix errors with. Default: "remat.find_blocks".

    Returns:
        A non-empty list of ``(qualified_name, module)`` pairs, names as in
        ``model.named_modules()``.

    Raises:
        BlocksNotFound: nothing matched; the message lists what was searched.
        TypeError: ``blocks`` is not a valid :data:`BlocksSpec`.

    Example::

        >>> from remat.models import build_model
        >>> [name for name, _ in named_blocks(build_model("gpt-tiny"))]
        ['blocks.0', 'blocks.1']
    """
    if blocks is None:
        return _detect_blocks(model, api)
    predicate = _as_predicate(blocks, api)
    found: list[tuple[str, nn.Module]] = []
    matched: list[str] = []
    for name, module in _walk_outermost(model, predicate):
        matched.append(name)
        found.extend(_expand_container(name, module, predicate))
    if not found and matched:
        raise BlocksNotFound(message(
            api, f"blocks={_describe_spec(blocks)} matched only empty containers "
            f"({', '.join(matched[:4])})",
            {"why": "empty containers are never called, so there is nothing to checkpoint"},
            fix=_BLOCKS_HINT))
    if not found:
        raise BlocksNotFound(message(
            api, f"blocks={_describe_spec(blocks)} matched no submodule of "
            f"{type(model).__name__}",
            {"searched": f"{sum(1 for _ in model.named_modules()) - 1} submodules",
             "classes present": _class_summary(model)},
            fix=_BLOCKS_HINT))
    return found


def find_blocks(model: nn.Module, blocks: BlocksSpec = None) -> list[nn.Module]:
    """The repeated blocks of ``model``, in forward order; see :func:`named_blocks`.

    Example::

        >>> from remat.models import build_model
        >>> len(find_blocks(build_model("llama-tiny")))
        2
    """
    return [module for _, module in named_blocks(model, blocks)]


# --------------------------------------------------------------------------- explicit specs


def _as_predicate(blocks: BlocksSpec, api: str) -> Callable[[str, nn.Module], bool]:
    if isinstance(blocks, type):
        if not issubclass(blocks, nn.Module):
            raise TypeError(message(api, f"blocks={blocks.__name__} is not an nn.Module subclass",
                                    fix=_BLOCKS_HINT))
        cls = blocks
        return lambda _name, module: isinstance(module, cls)
    if isinstance(blocks, Sequence) and not isinstance(blocks, str):
        classes = tuple(blocks)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not classes:
            raise TypeError(message(api, "blocks= as a sequence must hold nn.Module subclasses",
                                    {"found": repr(blocks)}, fix=_BLOCKS_HINT))
        return lambda _name, module: isinstance(module, classes)
    if callable(blocks):
        return blocks
    raise TypeError(message(
        api, "blocks= must be an nn.Module subclass, a sequence of them, a predicate "
        "(name, module) -> bool, or None", {"found": type(blocks).__name__}, fix=_BLOCKS_HINT))


def _walk_outermost(
    model: nn.Module, predicate: Callable[[str, nn.Module], bool]
) -> Iterator[tuple[str, nn.Module]]:
    """Depth-first in registration order, not descending into matches; the root is skipped."""

    def visit(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if predicate(name, child):
                yield name, child
            else:
                yield from visit(name, child)

    yield from visit("", model)


# NOTE [ Containers in a blocks spec ]
# A spec such as ``lambda n, m: n.startswith("model.layers")`` matches the ModuleList
# ``model.layers`` itself before its layers. A ModuleList or ModuleDict is never called
# (it has no forward), so checkpointing it would install a region that never runs: a
# silent no-op. Such a match is expanded to its members (recursively). An nn.Sequential
# is called, so it stays one block unless the spec also matches its members, which then
# are the blocks the spec meant.


def _expand_container(name: str, module: nn.Module, predicate: Callable[[str, nn.Module], bool],
                      *, nested: bool = False) -> list[tuple[str, nn.Module]]:
    """A matched container stands for its members (NOTE [ Containers in a blocks spec ])."""
    members = [(f"{name}.{n}", m) for n, m in module.named_children()]
    if isinstance(module, nn.Sequential) and nested:
        return [(name, module)]
    if isinstance(module, nn.Sequential) and not any(predicate(n, m) for n, m in members):
        return [(name, module)]
    if not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return [(name, module)]
    return [leaf for n, m in members for leaf in _expand_container(n, m, predicate, nested=True)]


def _describe_spec(blocks: BlocksSpec) -> str:
    if isinstance(blocks, type):
        return blocks.__name__
    if isinstance(blocks, Sequence):
        return "(" + ", ".join(getattr(c, "__name__", repr(c)) for c in blocks) + ")"
    return getattr(blocks, "__name__", "<predicate>")


def _class_summary(model: nn.Module, limit: int = 12) -> str:
    names: list[str] = []
    for _, m in model.named_modules():
        n = type(m).__name__
        if m is not model and n not in names:
            names.append(n)
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "") or "none"


# --------------------------------------------------------------------------- detection


class _Candidate:
    __slots__ = ("container", "cls", "layers", "members", "params")

    def __init__(self, container: str, cls: type[nn.Module],
                 members: list[tuple[str, nn.Module]], params: int, layers: bool) -> None:
        self.container = container
        self.cls = cls
        self.members = members
        self.params = params
        self.layers = layers  # >= 2 members, each with children (Rule 3)


def _param_count(modules: Sequence[nn.Module]) -> int:
    seen: set[int] = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _candidates(model: nn.Module) -> tuple[list[_Candidate], list[str]]:
    """Candidate groups (Rule 1, 2) and a description of every container searched."""
    candidates: list[_Candidate] = []
    searched: list[str] = []
    for name, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_class: dict[type[nn.Module], list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            by_class.setdefault(type(child), []).append((qualified, child))
        label = name or "<root>"
        kinds = ", ".join(f"{cls.__name__} x{len(ms)}" for cls, ms in by_class.items())
        searched.append(f"{label} ({type(container).__name__}: {kinds or 'empty'})")
        _join_first(container, name, by_class)
        for cls, members in by_class.items():
            # A one-layer model still has a layer stack: a ModuleList holding one block.
            single_stack = isinstance(container, nn.ModuleList) and len(by_class) == 1
            if (len(members) < 2 and not single_stack) or issubclass(
                cls, (nn.ModuleList, nn.ModuleDict)
            ):
                continue
            params = _param_count([m for _, m in members])
            if params > 0:
                layers = len(members) >= 2 and all(_has_children(m) for _, m in members)
                candidates.append(_Candidate(name, cls, members, params, layers))
    return candidates, searched


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _forward_parameters(module: nn.Module) -> tuple[str, ...] | None:
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return None
    return tuple(signature.parameters)


def _join_first(container: nn.Module, name: str,
                by_class: dict[type[nn.Module], list[tuple[str, nn.Module]]]) -> None:
    """The container's first member joins the repeated class right after it when it has
    the same shape (Rule 1 of NOTE [ Default block detection ]); ``by_class`` is updated."""
    children = list(container.named_children())
    if len(children) < 3:
        return
    (first_name, first), (_, second) = children[0], children[1]
    first_cls, cls = type(first), type(second)
    if first_cls is cls or len(by_class.get(first_cls, [])) != 1 or len(by_class[cls]) < 2:
        return
    if isinstance(first, (nn.ModuleList, nn.ModuleDict)) or not _has_children(second):
        return
    signature = _forward_parameters(first)
    if signature is None or signature != _forward_parameters(second):
        return
    kinds = {type(c) for c in first.children()}
    if not all(type(c) in kinds for c in second.children()):
        return
    qualified = f"{name}.{first_name}" if name else first_name
    del by_class[first_cls]
    by_class[cls].insert(0, (qualified, first))


def _detect_blocks(model: nn.Module, api: str) -> list[tuple[str, nn.Module]]:
    candidates, searched = _candidates(model)
    if not candidates:
        where = "; ".join(searched) if searched else "none: the model has no nn.ModuleList, "
        where += "" if searched else "nn.Sequential or nn.ModuleDict"
        raise BlocksNotFound(message(
            api, f"no repeated blocks found in {type(model).__name__}",
            {"blocks are": ">= 2 same-class modules with parameters in one container",
             "searched containers": where}, fix=_BLOCKS_HINT))
    largest = max(c.params for c in candidates)
    # Largest first; on ties, the outer container (fewer dots) first. See Rule 3.
    ordered = sorted(candidates, key=lambda c: (-c.params, c.container.count(".")))
    kept: list[tuple[str, nn.Module]] = []
    for cand in ordered:
        if cand.params < _MIN_SHARE * largest and not cand.layers:
            continue
        if any(_overlaps(name, other) for name, _ in cand.members for other, _ in kept):
            continue
        kept.extend(cand.members)
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules(remove_duplicate=False))}
    kept.sort(key=lambda nm: order.get(id(nm[1]), len(order)))  # See Rule 4.
    return kept


def _overlaps(a: str, b: str) -> bool:
    """True when qualified name ``a`` equals, contains or is contained in ``b``."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


# --------------------------------------------------------------------------- sub-layers

# NOTE [ Method sub-layers ]
#   Many blocks write attention and MLP as methods of the block (``self._attention_forward
#   (x, mask)``, ``self._ffn(x)``), with no module of their own. Such a method is a
#   sub-layer too, when the block has no sub-layer *module* of that kind (modules keep
#   priority). The matcher, in order:
#   Rule 1: candidates are plain functions defined on the module's class or a base class
#           below ``nn.Module`` (``vars(cls)``, in definition order), except ``forward``,
#           dunders, static/class methods and names ``nn.Module`` itself defines.
#   Rule 2: a candidate's name is compared with the kind's names (``_SUBLAYER_NAMES``,
#           case-insensitively) as written less its leading underscores, and also less a
#           ``_forward`` or ``_block`` suffix or a ``forward_`` prefix:
#           ``_attention_forward`` -> ``attention``, ``attn_forward`` -> ``attn``,
#           ``_ffn`` -> ``ffn``, ``_ff_block`` -> ``ff`` (``nn.TransformerEncoderLayer``
#           and ``nn.TransformerDecoderLayer``); ``feed_forward`` matches as written.
#           The kind's names are tried in order, so ``attn`` beats ``attention`` when a
#           block has both.
#   Rule 3: ``names=`` may name a method (or ``"child.method"``) exactly; it is tried
#           after the module names and before Rule 2.
#   A method sub-layer is installed on the instance (NOTE [ Instance forward ] in
#   remat/strategies/regions.py), so it must be called as ``self.<name>(...)``.


@dataclass(frozen=True, repr=False)
class BlockMethod:
    """A sub-layer written as a method of a module: ``owner.<name>(...)`` (NOTE [ Method
    sub-layers ]).

    Args:
        owner: the module whose class defines the method (a block, or a module inside one).
        name: the method's name, e.g. ``"_attention_forward"``.

    Example::

        >>> BlockMethod(block, "_attention_forward")(x, mask)  # calls block's method
    """

    owner: nn.Module
    name: str

    def __post_init__(self) -> None:
        if self.name not in block_methods(self.owner):
            raise ValueError(message(
                "BlockMethod", f"{type(self.owner).__name__} defines no method {self.name!r} "
                "that can be a sub-layer",
                {"its methods": ", ".join(block_methods(self.owner)) or "none"},
                fix="name a method defined on the module's own class (not forward)"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.owner, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"BlockMethod({type(self.owner).__name__}.{self.name})"


Sublayer: TypeAlias = nn.Module | BlockMethod
"""A sub-layer: a module, or a method of a module (:class:`BlockMethod`)."""

_MODULE_NAMES = frozenset(dir(nn.Module))


def block_methods(module: nn.Module) -> list[str]:
    """The methods of ``module`` that can be sub-layers (Rule 1 of NOTE [ Method sub-layers ]),
    in definition order, the module's own class first.

    Example::

        >>> block_methods(block)
        ['_attention_forward', '_ffn_forward']
    """
    found: list[str] = []
    for cls in type(module).__mro__:
        if cls is nn.Module or not issubclass(cls, nn.Module):
            continue
        for name, value in vars(cls).items():
            if (inspect.isfunction(value) and name != "forward" and name not in _MODULE_NAMES
                    and not (name.startswith("__") and name.endswith("__"))
                    and name not in found):
                found.append(name)
    return found


def _method_spellings(name: str) -> set[str]:
    """``name`` less leading underscores, with and without a ``_forward`` / ``_block``
    suffix or a ``forward_`` prefix, lower-cased (Rule 2 of NOTE [ Method sub-layers ])."""
    bare = name.lstrip("_").lower()
    out = {bare}
    for suffix in ("_forward", "_block"):
        if bare.endswith(suffix) and len(bare) > len(suffix):
            out.add(bare[: -len(suffix)])
    if bare.startswith("forward_") and len(bare) > len("forward_"):
        out.add(bare[len("forward_"):])
    return out


def sublayer_at(block: nn.Module, path: str) -> Sublayer | None:
    """The module or method at ``path`` inside ``block`` (``"self_attn"``, ``"attn.proj"``,
    ``"_attention_forward"``, ``"attn._core"``), or None.

    Example::

        >>> sublayer_at(block, "_ffn_forward")
        BlockMethod(DecoderLayer._ffn_forward)
    """
    try:
        return block.get_submodule(path)
    except AttributeError:
        pass
    owner_path, _, method = path.rpartition(".")
    try:
        owner = block.get_submodule(owner_path) if owner_path else block
    except AttributeError:
        return None
    return BlockMethod(owner, method) if method in block_methods(owner) else None


SublayerKind = Literal["attn", "mlp"]

_SUBLAYER_NAMES: dict[str, tuple[str, ...]] = {
    "attn": ("attn", "attention", "self_attn", "self_attention", "attn_layer", "SelfAttention",
             "selfattn", "mixer", "attn_block", "multihead_attn", "mha"),
    "mlp": ("mlp", "ffn", "feed_forward", "feedforward", "ff", "DenseReluDense", "mlp_layer",
            "ffn_layer", "mlp_block", "block_sparse_moe", "moe"),
}
_SUBLAYER_CLASS_HINTS: dict[str, tuple[str, ...]] = {
    "attn": ("attention", "attn"),
    "mlp": ("mlp", "feedforward", "ffn", "densereludense", "swiglu", "geglu"),
}


def find_sublayer(
    block: nn.Module, kind: SublayerKind, *, names: Sequence[str] | None = None
) -> tuple[str, Sublayer]:
    """The attention or MLP sub-layer of ``block``: a module, or a method of the block.

    Search order: direct children named like the kind (attention: ``attn``, ``attention``,
    ``self_attn``, ``self_attention``, ``SelfAttention`` ...; MLP: ``mlp``, ``ffn``,
    ``feed_forward``, ``ff``, ``DenseReluDense`` ...), then descendants with such a name
    (shallowest first), then descendants whose class name contains ``Attention``/``Attn`` or
    ``MLP``/``FeedForward``/``FFN``; then, for blocks that write the sub-layer as a method
    (``def _attention_forward(self, x, mask)``), the block's methods named like the kind
    less leading underscores and a ``_forward`` affix (NOTE [ Method sub-layers ]). A
    module always wins over a method. Some layouts have no single MLP module or method
    (Hugging Face BERT/ViT split it into ``intermediate`` and ``output``): those raise,
    pass ``names=``.

    Args:
        block: one block, e.g. an element of :func:`find_blocks`.
        kind: "attn" or "mlp".
        names: names (or dotted paths inside the block) of modules or methods to use
            instead of the defaults, in order of preference; the class-name fallback is
            then skipped. Default: None.

    Returns:
        ``(name, sublayer)`` where ``name`` is relative to ``block``: for a module,
        ``block.get_submodule(name)`` is ``sublayer``; for a method, ``sublayer`` is a
        :class:`BlockMethod` and ``name`` its name (``"_attention_forward"``).

    Raises:
        BlocksNotFound: nothing matched; the message lists the block's children and the
            methods that could be sub-layers.
        ValueError: unknown ``kind``.

    Example::

        >>> from remat.models import build_model
        >>> find_sublayer(build_model("llama-tiny").blocks[0], "mlp")[0]
        'mlp'
    """
    if kind not in _SUBLAYER_NAMES:
        raise ValueError(message("remat.find_sublayer", "kind must be 'attn' or 'mlp'",
                                 {"found": repr(kind)}, fix="pass kind='attn' or kind='mlp'"))
    wanted = tuple(names) if names is not None else _SUBLAYER_NAMES[kind]
    found: tuple[str, Sublayer] | None = _find_module(block, kind, wanted,
                                                      explicit=names is not None)
    if found is None:
        found = _find_method(block, wanted, explicit=names is not None)
    if found is not None:
        return found
    children = dict(block.named_children())
    listing = ", ".join(f"{n} ({type(c).__name__})" for n, c in children.items()) or "none"
    facts = {"looked for names": ", ".join(wanted)}
    if names is None:
        facts["and classes containing"] = "/".join(_SUBLAYER_CLASS_HINTS[kind])
    facts["children"] = listing
    facts["methods"] = ", ".join(block_methods(block)) or "none"
    raise BlocksNotFound(message(
        "remat.find_sublayer", f"no {kind} sub-layer in {type(block).__name__}", facts,
        fix=f"pass names=['your_{kind}_child'] (a child, a dotted path or a method name)"))


def _find_module(block: nn.Module, kind: str, wanted: tuple[str, ...],
                 explicit: bool) -> tuple[str, nn.Module] | None:
    lowered = [n.lower() for n in wanted]
    children = dict(block.named_children())
    # 1. direct children (or explicit dotted paths), in order of preference.
    for n in wanted:
        if n in children:
            return n, children[n]
        if "." in n:
            try:
                return n, block.get_submodule(n)
            except AttributeError:
                pass
    for n in lowered:  # case-insensitive second pass
        for child_name, child in children.items():
            if child_name.lower() == n:
                return child_name, child
    descendants = [(name, m) for name, m in block.named_modules() if name]
    descendants.sort(key=lambda nm: nm[0].count("."))  # stable: shallowest first
    # 2. descendants whose own name matches.
    for n in lowered:
        for name, m in descendants:
            if name.rsplit(".", 1)[-1].lower() == n:
                return name, m
    # 3. class-name substring (defaults only).
    if not explicit:
        for hint in _SUBLAYER_CLASS_HINTS[kind]:
            for name, m in descendants:
                if hint in type(m).__name__.lower() and not isinstance(m, _CONTAINERS):
                    return name, m
    return None


def _find_method(block: nn.Module, wanted: tuple[str, ...],
                 explicit: bool) -> tuple[str, BlockMethod] | None:
    """NOTE [ Method sub-layers ]: exact names when explicit (Rule 3), then Rule 2."""
    if explicit:
        for n in wanted:
            found = sublayer_at(block, n)
            if isinstance(found, BlockMethod):
                return n, found
    methods = block_methods(block)
    spellings = {m: _method_spellings(m) for m in methods}
    for n in wanted:
        for m in methods:
            if n.lower() in spellings[m]:
                return m, BlockMethod(block, m)
    return None
