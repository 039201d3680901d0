"""Known values of small integer tensors in simulated steps, so fake runs branch like real ones.

NOTE [ Data-dependent branches under fake tensors ]
    Fake tensors carry no values, so code that looks at values cannot take the
    branch the real step takes. Libraries know this and fall back to their
    "tracing" path on fake tensors: transformers' ``is_tracing(t)`` is true for
    any ``FakeTensor``, and its mask code then skips the eager shortcuts it
    takes on real tensors (``find_packed_sequence_indices`` returns the packed
    mask instead of ``None`` after ``(mask[:, -1] == 0).all()``; SDPA gets a
    materialized mask instead of ``is_causal=True``, and GQA models then repeat
    K/V into contiguous copies): bytes the simulation would count and the real
    step never allocates.

    The values those branches read are small integer tensors derived from the
    batch (ids, positions, masks), from factory ops (``arange``) and from
    constants (``torch.tensor([-1, 0])``, whose value ``FakeTensor.constant``
    keeps). A fake
    tensor made from a real one keeps a CPU copy of its value, its *shadow*,
    when it is an integer or bool tensor of at most :data:`MAX_SHADOW_NUMEL`
    elements (:func:`remember`, called by ``remat.measure.fake``). While a
    :class:`~remat.measure.tracker.MemoryTracker` runs, every op whose tensor
    inputs all have shadows and whose outputs are small integer tensors is also
    run on the shadows (:func:`propagate`), and ``.item()`` / ``bool()`` of a
    shadowed tensor (``aten._local_scalar_dense``) returns the shadow's value
    (:func:`local_scalar`). transformers' ``is_fake_tensor`` answers ``False``
    for a shadowed tensor while the tracker is active (:func:`eager_branches`),
    so it takes the branch the real step takes, with the real data. Float
    tensors of the model or batch never get shadows (weights are too large to
    copy, and routing decisions of mixture-of-experts layers stay
    data-independent; see NOTE [ Grouped matmul under fake tensors ]); neither do
    outputs of random ops. A small float computed from known values only does
    (:func:`_may_have_value`): BART's decoder makes ``torch.ones(batch, seq)`` (float)
    when no decoder mask is given and transformers skips the causal mask after
    checking it is all ones; without its value the fake step materialized a
    4-D mask per layer, 16 KiB on the compat matrix's BART.
    A mutating op that cannot be replayed on shadows drops the shadows of its
    inputs' storages, so a stale value is never read.

NOTE [ Data-dependent shapes ]
    An op whose output *shape* depends on float values (``nonzero`` /
    ``torch.where(mask)`` over a router's top-k, as in transformers'
    ``experts_implementation="eager"`` loop over experts) cannot be simulated:
    which experts get how many tokens is decided by the weights. remat does not
    guess a routing; :func:`data_dependent_error` turns PyTorch's
    ``DynamicOutputShapeException`` into an error that says so and names the
    way out: the grouped expert implementations (``"grouped_mm"``, the default
    of transformers >= 5, and ``"batched_mm"``) have routing-independent shapes
    (NOTE [ Grouped matmul under fake tensors ]), so their simulated bytes hold
    for any routing, balanced or not; or profile on real tensors, which measure
    the routing of the given batch. A value read out of a float tensor, or out
    of an integer one without a shadow (``.item()``, ``.tolist()``: JetMoE's
    expert sizes, LED's "any global attention?"), raises
    ``DataDependentOutputException`` and gets the same treatment. The planner does
    not refuse such models: it measures them on a real copy (NOTE [ Planning on a
    real copy ] in planning/context.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from remat.measure.ledger import tensors_in

#: Largest tensor (elements) whose value a simulated step keeps: a (64, 1024) batch of ids.
MAX_SHADOW_NUMEL = 1 << 16

_aten = torch.ops.aten
_shadows = WeakTensorKeyDictionary()
_stale: set[int] = set()  # ids of storages mutated without their shadow


def _wants_shadow(t: Tensor) -> bool:
    return (not t.is_floating_point() and not t.is_complex() and t.numel() <= MAX_SHADOW_NUMEL
            and t.layout == torch.strided)


def _may_have_value(t: Tensor) -> bool:
    """An op output that can get a value: a small integer tensor (:func:`_wants_shadow`) or a
    small float computed from known values only (``torch.ones``), tested on size first,
    where most outputs (activations) fail.

    Only :func:`propagate` asks this: weights and float batch tensors never get shadows
    (:func:`remember`), so a float value known here comes from constants and small integers.
    """
    return t.numel() <= MAX_SHADOW_NUMEL and t.layout == torch.strided and not t.is_complex()


def remember(fake: Tensor, real: Tensor) -> None:
    """Keep ``real``'s value as ``fake``'s shadow when it is a small integer tensor."""
    if real.device.type != "meta" and not isinstance(real, FakeTensor) and _wants_shadow(real):
        with _disable_current_modes():
            _shadows[fake] = real.detach().to("cpu", copy=True)
        _stale.discard(id(fake.untyped_storage()))  # an id reused by a new storage


def _shadow(t: Tensor) -> Tensor | None:
    if not isinstance(t, FakeTensor):  # a real input (``lift_fresh`` of a constant) is known
        return t if t.device.type != "meta" and _wants_shadow(t) else None
    value = _shadows.get(t)
    if value is None and t.constant is not None:
        value = t.constant  # ``torch.tensor([...])`` under the fake mode keeps its value
    if value is None or id(t.untyped_storage()) in _stale:
        return None
    return value  # type: ignore[no-any-return]


def local_scalar(func: Any, args: Any) -> tuple[bool, Any]:
    """``(True, value)`` when ``func`` reads a scalar out of a shadowed fake tensor."""
    if func is _aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
        value = _shadow(args[0])
        if value is not None:
            with _disable_current_modes():
                return True, value.item()
    return False, None


def active() -> bool:
    """Whether any shadow exists (a cheap test before the per-op work)."""
    return len(_shadows) > 0


@contextmanager
def one_thread() -> Iterator[None]:
    """Run on the calling thread only (a shadow's replay; a real copy's small ops).

    Shadows are small (at most :data:`MAX_SHADOW_NUMEL` elements), yet some kernels
    (``tril``, SDPA's causal mask under fake tensors) open an OpenMP region for them: on a
    loaded machine each call then waits for a worker thread to be scheduled, and the
    workers spin afterwards. A fake step of a 32-layer GPT spent more CPU in those
    workers than in the replays themselves (benchmarks/plan_time.py).
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _tensors(value: Any) -> list[Tensor]:
    """The tensors of an aten op's result or argument tuple (nested one list deep at most,
    as aten schemas are; ``torch.utils._pytree`` would do, at ten times the cost per op)."""
    if isinstance(value, Tensor):
        return [value]
    return tensors_in(value) if isinstance(value, (tuple, list)) else []


def propagate(func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """Run ``func`` on the shadows of its inputs and give ``out`` the results' values."""
    outs = [t for t in _tensors(out) if isinstance(t, FakeTensor)]
    if not outs:
        return
    replayable = (all(_may_have_value(t) for t in outs)
                  and torch.Tag.nondeterministic_seeded not in func.tags)
    inputs = tensors_in(args, kwargs) if replayable or func._schema.is_mutable else []
    shadows: list[Tensor | None] = []
    for t in inputs if replayable else ():
        shadows.append(_shadow(t))
        if shadows[-1] is None:
            replayable = False
            break
    if not replayable:
        if func._schema.is_mutable:
            _stale.update(id(t.untyped_storage()) for t in inputs)
        return
    by_id = {id(t): s for t, s in zip(inputs, shadows, strict=True)}

    def real(x: Any) -> Any:
        if isinstance(x, Tensor):
            return by_id[id(x)]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    real_args, real_kwargs = tree_map(real, (args, kwargs))
    with _disable_current_modes(), one_thread():
        try:
            result = func(*real_args, **real_kwargs)
        except Exception:  # a kernel the shadows cannot run: the outputs stay unknown
            return
    values = _tensors(result)
    if len(values) == len(outs):
        for fake, value in zip(outs, values, strict=True):
            _shadows[fake] = value
            _stale.discard(id(fake.untyped_storage()))


@contextmanager
def eager_branches() -> Iterator[None]:
    """While active, transformers treats a shadowed fake tensor as a real one.

    See NOTE [ Data-dependent branches under fake tensors ]. A no-op without transformers,
    and where transformers is not imported yet: then no model in the process came from it
    (its models import it), and importing it here would cost a run without one (a
    built-in preset's ``remat simulate``) half a second.
    """
    import_utils: Any = sys.modules.get("transformers.utils.import_utils")
    if import_utils is None:
        yield
        return
    original = getattr(import_utils, "is_fake_tensor", None)
    if original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        if isinstance(x, FakeTensor) and _shadow(x) is not None:
            return False
        return bool(original(x))

    import_utils.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original


def data_dependent_error(func: Any, error: Exception) -> RuntimeError:
    """A RematError explaining a data-dependent output shape under fake tensors.

    See NOTE [ Data-dependent shapes ].
    """
    from remat.errors import RematError, message

    what = ("reads a tensor's value (.item(), .tolist(), a Python branch on a tensor)"
            if isinstance(error, DataDependentOutputException)
            else "has an output shape that depends on tensor values")
    return RematError(message(
        "remat.profile(simulate=True)", f"{func} {what}, which fake tensors do not have",
        {"likely": "a mixture-of-experts layer looping over experts with torch.where / "
                   "nonzero",
         "so": "simulated bytes would depend on a guessed routing",
         "error": f"{type(error).__name__}: {error}"},
        fix="for Hugging Face MoE models call model.set_experts_implementation('grouped_mm') "
            "(shapes, hence bytes, do not depend on routing), or profile on real tensors "
            "(simulate=False), which measure the routing of this batch"))
