"""One tensor-parallel rank's training step, simulated under a fake process group.

NOTE [ One tensor-parallel rank, simulated ]
    :func:`simulate_ranks` runs what rank 0 of ``t`` runs, not an arithmetic split of
    one device's step (torchtitan estimates FSDP memory the same way):

    1. a process group of the ``"fake"`` backend (PyTorch's ``FakeProcessGroup``:
       ``world_size=t``, ``rank=0``, collectives that move no data) and a
       one-dimensional CPU ``DeviceMesh`` over it;
    2. a meta copy of the model (the user's module is never changed), converted to
       the precision's parameter dtype and parallelized with the very plan and
       styles ``remat.integrations.tp.apply_tp`` uses (:mod:`remat.distributed.tp_layout`):
       parameters become DTensors over meta shards, attention head counts per-rank;
    3. the optimizer over those DTensors, then remat's simulated step
       (:class:`~remat.measure.profile.WarmFake`: a fake copy, a warm-up step, the
       strategy, one tracked step). The tracker counts each DTensor's local shard
       (NOTE [ Sharded models in the tracker ] in distributed/sharded.py), so parameters,
       gradients, optimizer state, activations and the peak are the rank's own:
       DTensor's redistributions (all-gathers, all-reduces, the vocabulary-parallel
       embedding's masked partial sums) allocate what they allocate on a real rank.

    Rank 0 holds the largest shard when a dimension does not divide. The optimizer
    runs ``foreach`` when every trainable parameter is a DTensor (with sequence
    parallelism) and per parameter otherwise: ``foreach`` kernels refuse lists that
    mix DTensors and plain tensors (the norms TP leaves alone without SP).

    Process-group state: ``torch.distributed`` has one default group per process.
    When none is initialized the fake group is created in this process and destroyed
    afterwards. Its mesh is named ``"remat-simulated-tp"`` so that it never equals a
    real mesh: ``DeviceMesh`` equality compares ranks, layout, device type and dimension
    names but not the process group, and DTensor caches its sharding decisions
    keyed by specs that hold the mesh. An unnamed fake mesh of ``t`` ranks equals
    the user's own one-dimensional CPU mesh of ``t`` ranks, and a later real step on it
    reused the simulation's decisions, with the destroyed fake group's mesh in them:
    its loss was right and its gradients wrong (block 0 and the embedding of a
    2-way llama-tiny off by up to 2.2x relative; tests/integrations/test_tp.py
    simulates before its gloo ranks fork to check it). When the caller's process
    already has one (a ``torchrun`` job planning its own step), it is left alone and
    the simulation runs in a fresh Python subprocess (a few seconds to start): replacing or
    sub-grouping the caller's group could change what its ranks agree on, and a fake
    group of ``t`` ranks cannot be a sub-group of a world of another size. The
    subprocess gets the arguments by pickle, so a model given as a lambda or a class
    defined in ``__main__`` is refused there with the fix.

    Not simulated: collective backends' own buffers (NCCL's live outside PyTorch's
    allocator; gloo's are short-lived copies on its worker thread).
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from remat.errors import RematError, RematWarning, message

API = "remat.distributed.tensor_parallel.tp_rank_bytes"


@dataclass(frozen=True)
class RankStep:
    """One rank's simulated step, bytes (NOTE [ One tensor-parallel rank, simulated ])."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    peak_bytes: int

    def __post_init__(self) -> None:
        sizes = (self.param_bytes, self.grad_bytes, self.optimizer_bytes,
                 self.activation_bytes, self.peak_bytes)
        if min(sizes) < 0:
            raise ValueError(message("RankStep", "sizes must be >= 0", {"sizes": sizes},
                                     fix="pass the figures of one rank"))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (tied
    weights stay tied; no data is copied; ``model`` is unchanged)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo.setdefault(id(p), nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo.setdefault(id(b), b.detach().to("meta"))
    return copy.deepcopy(model, memo)


@contextmanager
def fake_mesh(tp: int) -> Iterator[Any]:
    """A CPU ``DeviceMesh`` of ``tp`` ranks over a fake process group, as rank 0, named
    so that it equals no real mesh (NOTE [ One tensor-parallel rank, simulated ]); the
    group is destroyed on exit. The caller checks that no group exists yet."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("remat-simulated-tp",))
    finally:
        dist.destroy_process_group()


@contextmanager
def rank_model(model: Any, *, seq_len: int, tp: int, sequence_parallel: bool,
               dtype: str, api: str = API,
               prepare: Callable[[nn.Module], AbstractContextManager[Any]] | None = None,
               tp_plan: dict[str, Any] | None = None) -> Iterator[tuple[nn.Module, bool]]:
    """Rank 0's model of ``tp`` (steps 1. and 2. of NOTE [ One tensor-parallel rank,
    simulated ]): a meta copy in the precision's parameter dtype, in train mode,
    parallelized as ``apply_tp`` does on a fake mesh that lives as long as the context
    (``tp == 1``: the copy, no process group). Yields the model and whether every
    trainable parameter is a DTensor (``foreach`` optimizers refuse mixed lists).
    ``prepare(copy)``, a context entered before the conversion, may change the copy
    for the context (the pipeline rows cut its stack: only what is left is converted
    and parallelized). ``tp_plan``: the user's plan instead of remat's (NOTE [ A user's
    TP plan ] in remat/integrations/tp.py). The caller checks that no process group exists
    (:func:`run_isolated`)."""
    from remat.distributed.sharded import is_dtensor
    from remat.distributed.tp_layout import parallelize
    from remat.simulate.precision import get_precision
    from remat.simulate.sim_setup import build_model

    inner = meta_copy(model) if isinstance(model, nn.Module) else build_model(model, seq_len)[0]
    with prepare(inner) if prepare is not None else nullcontext(), \
            fake_mesh(tp) if tp > 1 else nullcontext() as mesh:
        inner.to(get_precision(dtype).param_dtype)
        inner.train()
        if mesh is not None:
            parallelize(inner, mesh, sequence_parallel=sequence_parallel, api=api,
                        tp_plan=tp_plan)
        trainable = [p for p in dict.fromkeys(inner.parameters()) if p.requires_grad]
        yield inner, all(is_dtensor(p) for p in trainable)


def step_failed(error: RuntimeError, model: nn.Module, *, tp: int, sequence_parallel: bool,
                api: str = API) -> RematError:
    """The error for a tensor-parallel step that fails on a rank (its warm-up raised)."""
    return RematError(message(
        api, f"the tensor-parallel step of {type(model).__name__} fails on a rank",
        {"tp": tp, "sequence parallel": sequence_parallel,
         "error": str(error).strip().splitlines()[-1][:200],
         "why": "the model's forward does not run under apply_tp's layout, and gloo "
                "ranks fail alike (e.g. Hugging Face Llama with sequence parallelism "
                "builds its rotary tables from the sequence-sharded residual stream)"},
        fix="drop sequence_parallel, or pass tp_plan= (--tp-plan) with your own layout"))


def _steps_in_process(model: Any, *, seq_len: int, points: Sequence[tuple[Any, int]],
                      tp: int, sequence_parallel: bool, dtype: str,
                      optimizer: str, tp_plan: dict[str, Any] | None = None,
                      ) -> list[RankStep]:
    from remat.measure.profile import WarmFake
    from remat.measure.step import Step, clear_grads
    from remat.measure.tracked_step import tracked_step
    from remat.simulate.precision import get_precision, make_optimizer
    from remat.simulate.sim_setup import Autocast, default_batch
    from remat.strategies import apply, remove

    precision = get_precision(dtype)
    out: list[RankStep] = []
    with rank_model(model, seq_len=seq_len, tp=tp, sequence_parallel=sequence_parallel,
                    dtype=dtype, tp_plan=tp_plan) as (inner, foreach):
        trainable = [p for p in dict.fromkeys(inner.parameters()) if p.requires_grad]
        opt = make_optimizer(optimizer, trainable, foreach=foreach)
        wrapped = precision.autocast_dtype is not None
        run_model = Autocast(inner, precision.autocast_dtype) if wrapped else inner  # type: ignore[arg-type]
        first = default_batch(inner, points[0][1], seq_len)
        try:
            warm = WarmFake(Step(run_model, first, optimizer=opt), first, prepare=remove)
        except RuntimeError as error:
            raise step_failed(error, inner, tp=tp, sequence_parallel=sequence_parallel) \
                from error
        fake_inner: nn.Module = warm.model.model if wrapped else warm.model  # type: ignore[assignment]
        for strategy, batch_size in points:  # one warm-up for all (see WarmFake)
            remove(fake_inner)
            with warnings.catch_warnings():
                # TP's redistribution hooks inside a checkpointed block replay the same
                # collectives in recompute (NOTE [ Order: tensor parallel, then checkpoint ])
                warnings.simplefilter("ignore", RematWarning)
                apply(fake_inner, strategy)
            fstep = warm._step(default_batch(inner, batch_size, seq_len))
            with warm.mode:
                clear_grads(warm.model)
                tracked = tracked_step(fstep, fstep.blocks_found(api=API, required=False))
            tracker = tracked.tracker
            out.append(RankStep(
                param_bytes=tracked.static.get("params", 0), grad_bytes=tracked.grad_bytes,
                optimizer_bytes=tracked.static.get("optimizer_state", 0),
                activation_bytes=tracker.activation_bytes, peak_bytes=tracker.peak_bytes))
    return out


def _in_subprocess(target: Callable[..., Any], kwargs: dict[str, Any], api: str) -> Any:
    """``target(**kwargs)`` in a fresh interpreter (NOTE [ One tensor-parallel rank,
    simulated ], process-group state); ``target`` is a module-level function."""
    try:
        payload = pickle.dumps((target, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise RematError(message(
            api, "torch.distributed is initialized here, and the model cannot be sent to "
            "the subprocess that simulates the rank", {"pickling": str(error)},
            fix="pass a preset name, a module-level factory or an nn.Module, or call before "
                "init_process_group")) from error
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])  # the directory holding remat
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "remat.distributed.tp_step"], input=payload,
                          capture_output=True, check=False, env=env)
    if done.returncode != 0:
        raise RematError(message(
            api, "the subprocess simulating the tensor-parallel rank failed",
            {"exit code": done.returncode,
             "its error": done.stderr.decode(errors="replace").strip().splitlines()[-1:]},
            fix=f"call {api.rpartition('.')[2]} before init_process_group to see the full "
                "error"))
    return pickle.loads(done.stdout)


def run_isolated(target: Callable[..., Any], kwargs: dict[str, Any], *, tp: int,
                 api: str = API) -> Any:
    """``target(**kwargs)``, in a subprocess when ``tp > 1`` and this process already has
    a ``torch.distributed`` group (NOTE [ One tensor-parallel rank, simulated ],
    process-group state): :func:`fake_mesh` needs a process without one."""
    import torch.distributed as dist

    if tp > 1 and dist.is_available() and dist.is_initialized():
        return _in_subprocess(target, kwargs, api)
    return target(**kwargs)


def simulate_ranks(model: Any, *, seq_len: int, points: Sequence[tuple[Any, int]], tp: int,
                   sequence_parallel: bool, dtype: str, optimizer: str,
                   tp_plan: dict[str, Any] | None = None) -> list[RankStep]:
    """Rank 0's bytes for one step under tensor parallelism of degree ``tp``, per point.

    See NOTE [ One tensor-parallel rank, simulated ]. One fake process group, one
    parallelized copy and one warm-up serve every point, so each further point costs
    one tracked step.

    Args:
        model: a preset name, a factory (called on the meta device) or a module (copied
            to the meta device; never changed).
        seq_len: tokens per sequence.
        points: ``(strategy, batch_size)`` pairs (a strategy name or config), simulated
            in order; at least one.
        tp: tensor-parallel degree (1: the one-device step, no process group).
        sequence_parallel, dtype, optimizer: as for
            :func:`remat.distributed.tensor_parallel.tp_rank_bytes`.
        tp_plan: the user's ``parallelize_module``-style plan (None: remat's layout).

    Returns:
        One :class:`RankStep` per point.

    Example:
        >>> [r.param_bytes for r in simulate_ranks(
        ...     "llama-tiny", seq_len=16, points=[("full", 2)], tp=2,
        ...     sequence_parallel=True, dtype="fp32", optimizer="sgd")]  # doctest: +SKIP
        [251136]
    """
    if not points:
        raise ValueError(message(API, "no (strategy, batch_size) point to simulate",
                                 fix="pass at least one point"))
    kwargs = {"model": model, "seq_len": seq_len, "points": list(points), "tp": tp,
              "sequence_parallel": sequence_parallel, "dtype": dtype, "optimizer": optimizer,
              "tp_plan": tp_plan}
    out: list[RankStep] = run_isolated(_steps_in_process, kwargs, tp=tp)
    return out


if __name__ == "__main__":  # the subprocess of _in_subprocess
    warnings.simplefilter("ignore")
    function, arguments = pickle.loads(sys.stdin.buffer.read())  # by module name
    sys.stdout.buffer.write(pickle.dumps(function(**arguments)))
