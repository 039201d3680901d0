"""Op-level selective activation checkpointing (SAC) policies.

Selective checkpointing keeps the outputs of chosen ops and recomputes the rest
of a region in backward. Compute-heavy ops (matmuls, attention kernels,
convolutions) cost many FLOPs to redo but their outputs are a small share of a
block's saved bytes; pointwise ops and norms are cheap to redo and often
dominate the bytes. Saving the former and recomputing the latter buys most of
full checkpointing's memory for a fraction of its recompute time.

A save set names ops two ways: ``"aten.mm"`` keeps the output of every call of
that op in the region; ``"aten.mm#2"`` keeps only the third call's (calls are
counted per op name in the order the region's forward runs them; see NOTE
[ Per-call save sets ]). Per-call entries let a plan keep, say, an MLP's down
projection and recompute its gate and up projections, which by name alone are
indistinguishable.

See ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

NOTE [ Per-call save sets ]
    SAC's own caches index an op's outputs by call order within the region, and
    the policy is consulted once per op call of the region's forward (and, in
    older PyTorch releases, again during recompute, with ``ctx.is_recompute``).
    :class:`SavePolicy` counts calls per op name separately for the two, so the
    k-th call of ``aten.mm`` means the same op in forward and in recompute as long
    as the region's control flow is deterministic, which non-reentrant
    checkpointing requires anyway. A fresh policy is made for every checkpointed
    call (``sac_context_fn`` builds one per ``context_fn()`` call), so counts
    never leak between steps. Under ``torch.compile`` the policy sees the traced
    (possibly decomposed) ops, so per-call indices may select different calls
    than in eager; gradients are unaffected, only what is kept.

NOTE [ Saved outputs mutated in place ]
    SAC caches a saved op's output (a detached alias) and, in backward, hands
    it back instead of recomputing the op; it refuses a cached tensor whose
    version counter moved ("Tensor cached during selective activation
    checkpoint has been mutated"), since recomputing from a value the forward
    later changed in place would give wrong gradients. Models do mutate op
    outputs: DeBERTa-v2's disentangled attention builds ``score = c2p / s``
    and then runs ``score += p2c / s``, so a save set holding that ``add``
    (which the planner may choose) crashed the planner.
    The policy sees every op of the region's forward right after it runs, in
    place ones included, so when an op writes into a tensor whose storage a
    cached entry shares, :class:`SavePolicy` turns that entry back into
    "recompute" (``_RECOMPUTE`` in SAC's storage, the same marker the policy's
    PREFER_RECOMPUTE leaves): the output is recomputed in backward from its
    inputs, exactly as if the save set had not named it, and its memory is
    released with the entry. Gradients equal the un-checkpointed model's.

    PyTorch before ``_RECOMPUTE`` existed (2.12 and older; found on 2.11) keeps
    a list per op instead, appended in forward and popped in order in recompute,
    where it asks the policy again (``ctx.is_recompute``) before it runs (not
    after) each op. There the entry is taken out of its list, and the policy
    answers PREFER_RECOMPUTE for that call in recompute, so the lists stay
    aligned with the calls that pop them (:meth:`SavePolicy._forget_listed`).
    Under ``torch.compile`` those releases store and pop every op whatever the
    policy says, so nothing is taken out there.

NOTE [ Skipping only where it pays ]
    Dead-op skipping (NOTE [ Dead ops in recompute ] in dead_ops.py) costs a few
    microseconds of bookkeeping per op of the region's forward, and most save sets
    leave no dead op (a matmul or attention output kept: its inputs are packed
    for its backward anyway). So each region's ``context_fn`` learns from its
    first recompute: if it skipped nothing (or its ledger could not follow the
    region), later forwards get stock SAC contexts, with no bookkeeping, and cost
    what hand-written ``create_selective_checkpoint_contexts`` costs; if it skipped
    some, every later forward keeps the ledger, which checks the dead calls anew
    each step (nothing is assumed from earlier steps). A region whose later steps
    would have dead ops its first did not merely misses the saving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat.errors import message
from remat.strategies.dead_ops import dead_op_contexts, skip_dead_ops_enabled, supported
from remat.strategies.sac_rng import names_random_op, rng_replay

#: aten overload packets that do the heavy math, as seen by the dispatcher
#: (``nn.Linear`` and ``matmul`` decompose into mm/addmm/bmm before dispatch).
COMPUTE_HEAVY_OPS: frozenset[str] = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._scaled_mm",
        "aten.convolution",
        "aten._convolution",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_fused_attention_overrideable",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)


def default_save_ops() -> frozenset[str]:
    """The op set the ``"ops"`` strategy saves: :data:`COMPUTE_HEAVY_OPS`."""
    return COMPUTE_HEAVY_OPS


def op_name(func: Any) -> str:
    """``"aten.mm"`` for ``torch.ops.aten.mm.default`` (the overload packet's name)."""
    packet = getattr(func, "overloadpacket", func)
    return str(packet)


def call_entry(name: str, index: int) -> str:
    """The save-set entry for the ``index``-th call (from 0) of op ``name``: ``"aten.mm#2"``."""
    return f"{name}#{index}"


def parse_entry(entry: str) -> tuple[str, int | None]:
    """``("aten.mm", 2)`` for ``"aten.mm#2"``, ``("aten.mm", None)`` for ``"aten.mm"``.

    Raises:
        ValueError: an empty name, or an index that is not a non-negative integer.

    Example:
        >>> parse_entry("aten.mm#2")
        ('aten.mm', 2)
    """
    name, sep, index = entry.partition("#")
    if not name or (sep and not index.isdigit()):
        raise ValueError(message(
            "", f"save-set entry {entry!r} is not an op name or an op call",
            fix="write an op name ('aten.mm') or an op call ('aten.mm#2': the third call of "
                "aten.mm in the region)"))
    return name, int(index) if sep else None


def split_entries(entries: Iterable[str]) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
    """``(op names, (op name, call index) pairs)`` of save-set entries (:func:`parse_entry`).

    Example:
        >>> split_entries({"aten.addmm", "aten.mm#1"})
        (frozenset({'aten.addmm'}), frozenset({('aten.mm', 1)}))
    """
    names: set[str] = set()
    calls: set[tuple[str, int]] = set()
    for entry in entries:
        name, index = parse_entry(entry)
        if index is None:
            names.add(name)
        else:
            calls.add((name, index))
    return frozenset(names), frozenset(calls)


#: SAC keeps a list per op, popped in order, and asks the policy again in recompute
#: (PyTorch without ``torch.utils.checkpoint._RECOMPUTE``, 2.12 and older).
_LISTED_STORAGE = not hasattr(_checkpoint, "_RECOMPUTE")


def _compiling(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """SAC's own test for tracing under ``torch.compile`` (it then stores every op)."""
    check = getattr(_checkpoint, "_is_compiling", None)
    return bool(check(func, args, kwargs)) if check is not None else False


def _written(entry: Any, written: list[Any]) -> bool:
    """Whether a SAC cache entry holds a tensor in one of the ``written`` storages."""
    leaves = entry if isinstance(entry, (tuple, list)) else (entry,)
    return any(isinstance(getattr(leaf, "val", None), Tensor)
               and any(leaf.val.untyped_storage() is st for st in written)
               for leaf in leaves)


class SavePolicy:
    """A SAC policy: save the outputs of the named ops and op calls, recompute the rest.

    Args:
        save_ops: entries as :func:`parse_entry` reads them.

    Example:
        >>> policy = SavePolicy({"aten.addmm", "aten.mm#1"})
    """

    def __init__(self, save_ops: Iterable[str]) -> None:
        self.names, self.calls = split_entries(save_ops)
        self._counted = frozenset(n for n, _ in self.calls)
        self._counts: dict[bool, dict[str, int]] = {False: {}, True: {}}
        #: SAC's cache of saved outputs (set by :func:`sac_context_fn`); see NOTE [ Saved
        #: outputs mutated in place ].
        self.cache: Any = None
        #: The forward's ledger when the recompute skips dead ops (NOTE [ Dead ops in
        #: recompute ] in dead_ops.py), else ``None``.
        self.ledger: Any = None
        #: How many times each op ran in the forward (not the recompute): what a save
        #: set can name in this region (regions.py checks it once).
        self.seen: dict[str, int] = {}
        #: The decision for the op that runs next (read by sac_rng's forward mode).
        self.last: CheckpointPolicy | None = None
        # SAC storage as lists (NOTE [ Saved outputs mutated in place ], last paragraph):
        # per overload (by id) and phase, calls so far; the forward calls whose outputs sit
        # in the overload's list, in order; the (overload id, call) pairs taken out.
        self._calls: dict[bool, dict[int, int]] = {False: {}, True: {}}
        self._listed: dict[int, list[int]] = {}
        self._forgotten: set[tuple[int, int]] = set()

    def _forget_mutated(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # NOTE [ Saved outputs mutated in place ].
        recompute = getattr(_checkpoint, "_RECOMPUTE", None)
        if not isinstance(self.cache, dict):
            return
        written = []
        for i, arg in enumerate(func._schema.arguments):
            alias = arg.alias_info
            if alias is None or not alias.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            if isinstance(value, Tensor):
                written.append(value.untyped_storage())
        if not written:
            return
        if recompute is None:
            self._forget_listed(written)
            return
        for entries in self.cache.values():
            if not isinstance(entries, dict):
                continue
            for idx, entry in entries.items():
                if _written(entry, written):
                    entries[idx] = recompute

    def _forget_listed(self, written: list[Any]) -> None:
        """Take mutated entries out of SAC's per-op lists (storage before ``_RECOMPUTE``)."""
        for key, entries in self.cache.items():
            listed = self._listed.get(id(key))
            if not isinstance(entries, list) or listed is None or len(listed) != len(entries):
                continue  # not one this policy can follow: SAC's own check stays
            for pos in range(len(entries) - 1, -1, -1):
                if _written(entries[pos], written):
                    del entries[pos]
                    self._forgotten.add((id(key), listed.pop(pos)))

    def _decide(self, ctx: Any, func: Any) -> CheckpointPolicy:
        name = op_name(func)
        if not getattr(ctx, "is_recompute", False):
            self.seen[name] = self.seen.get(name, 0) + 1
        if name in self.names:
            return CheckpointPolicy.MUST_SAVE
        if name in self._counted:  # NOTE [ Per-call save sets ]
            counts = self._counts[bool(getattr(ctx, "is_recompute", False))]
            index = counts.get(name, 0)
            counts[name] = index + 1
            if (name, index) in self.calls:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (self.cache is not None and func._schema.is_mutable
                and not getattr(ctx, "is_recompute", False)):  # forward mutations only
            self._forget_mutated(func, args, kwargs)
        policy = self._decide(ctx, func)
        if _LISTED_STORAGE and self.cache is not None and not _compiling(func, args, kwargs):
            recompute = bool(getattr(ctx, "is_recompute", False))
            calls = self._calls[recompute]
            index = calls.get(id(func), 0)
            calls[id(func)] = index + 1
            if recompute:
                if (id(func), index) in self._forgotten:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            elif policy == CheckpointPolicy.MUST_SAVE:  # SAC appends the output next
                self._listed.setdefault(id(func), []).append(index)
        self.last = policy  # NOTE [ Kept random ops and the RNG ] in sac_rng.py
        return policy


def make_policy(save_ops: Iterable[str]) -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy saving the outputs of ``save_ops`` (names or calls; see module doc)."""
    return SavePolicy(save_ops)


def sac_context_fn(save_ops: Iterable[str]) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` implementing the policy.

    Each call makes a fresh :class:`SavePolicy` (per-call counts start at zero); the
    last one is ``context_fn.last_policy`` (its ``seen`` ops are checked by the region).
    Outside ``torch.compile`` the recompute skips dead ops (NOTE [ Dead ops in
    recompute ] in dead_ops.py) unless :func:`~remat.strategies.dead_ops.skipping_dead_ops`
    turned it off, and only in regions where it pays (NOTE [ Skipping only where it
    pays ]): ``context_fn.skips`` is ``None`` until the region's first recompute, then
    whether that recompute skipped any op. A save set naming a random op also replays the
    generator states the kept ones leave (NOTE [ Kept random ops and the RNG ] in
    sac_rng.py) until ``context_fn.replays`` turns False.

    Example:
        >>> fn = sac_context_fn({"aten.mm"})
        >>> fwd_ctx, recompute_ctx = fn()
    """
    entries = frozenset(save_ops)
    keeps_random = names_random_op(parse_entry(e)[0] for e in entries)

    def context_fn() -> tuple[Any, Any]:
        _learn_verdict(context_fn)
        policy = SavePolicy(entries)
        # Dynamo's own flag, or AOTAutograd tracing the region (torch 2.11 calls
        # context_fn there with the flag down): SAC's contexts must stay modes alone.
        compiling = torch.compiler.is_compiling() or _compiling(None, (), {})
        if (context_fn.skips is not False  # type: ignore[attr-defined]
                and skip_dead_ops_enabled() and supported() and not compiling):
            forward_ctx, recompute_ctx, policy.ledger = dead_op_contexts(policy)
        else:
            forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
        policy.cache = getattr(forward_ctx, "storage", None)
        context_fn.last_policy = policy  # type: ignore[attr-defined]
        if keeps_random and context_fn.replays and not compiling:  # type: ignore[attr-defined]
            forward_ctx, recompute_ctx, context_fn.rng_log = rng_replay(  # type: ignore[attr-defined]
                forward_ctx, recompute_ctx, policy)
        if not compiling:  # NOTE [ Cached outputs no recompute reads ]
            recompute_ctx = _DroppingLeftovers(recompute_ctx, policy)
        return forward_ctx, recompute_ctx

    context_fn.last_policy = None  # type: ignore[attr-defined]
    context_fn.skips = None  # type: ignore[attr-defined]
    context_fn.rng_log = None  # type: ignore[attr-defined]
    context_fn.replays = True  # type: ignore[attr-defined]
    return context_fn


class _DroppingLeftovers:
    """``recompute_ctx``, then SAC's cache of the region's saved outputs emptied.
    Re-enterable, as the recompute context is (each backward through the region
    enters it again).

    NOTE [ Cached outputs no recompute reads ]
        SAC caches each saved op's output in forward and hands it back (popping it) when
        the recompute reaches that op. A recompute that stops early (every tensor
        backward needs is back) never reaches the region's last saved ops, so their
        outputs would stay in the cache, and the cache alive with the region's
        context function (``context_fn.last_policy``, kept for the next call's verdicts)
        until the next forward: one hidden state per block held through the optimizer
        step, which can put ``ops`` above ``none`` at the step's peak. SAC refuses a
        second backward through a region ("Trying to backward an extra time": an entry
        marked consumed), so once the recompute has ended no entry can be read again:
        the unread ones are marked consumed there (popped lists, on older torch, are
        emptied).
    """

    def __init__(self, recompute_ctx: Any, policy: SavePolicy) -> None:
        self.inner = recompute_ctx
        self.policy = policy

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            _drop_leftovers(self.policy.cache)


def _drop_leftovers(cache: Any) -> None:
    """Mark every cached output no recompute read as consumed (NOTE [ Cached outputs no
    recompute reads ])."""
    if not isinstance(cache, dict):
        return
    consumed = getattr(_checkpoint, "_CONSUMED", None)
    recompute = getattr(_checkpoint, "_RECOMPUTE", None)
    for entries in cache.values():
        if isinstance(entries, list):  # popped in order (torch 2.12 and older)
            entries.clear()
        elif isinstance(entries, dict) and consumed is not None:
            for index, entry in entries.items():  # marked, not popped
                if entry is not consumed and entry is not recompute:
                    entries[index] = consumed


def _learn_verdict(context_fn: Any) -> None:
    """NOTE [ Skipping only where it pays ]: after the first recompute of a region, set
    ``context_fn.skips`` to whether that recompute skipped anything; and ``replays`` to
    False once a call showed the RNG replay is not needed (NOTE [ Kept random ops and the
    RNG ] in sac_rng.py)."""
    log = context_fn.rng_log  # NOTE [ Kept random ops and the RNG ] in sac_rng.py
    if log is not None and log.settled_without_replay():
        context_fn.replays = False
    if context_fn.skips is not None:
        return
    ledger = getattr(context_fn.last_policy, "ledger", None)
    if ledger is not None and ledger.finished:
        context_fn.skips = not ledger.broken and ledger.skipped > 0
