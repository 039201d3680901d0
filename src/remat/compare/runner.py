"""Run every checkpointing strategy on the same model and batch, side by side.

:func:`compare` is the library function behind ``remat compare``. For each
strategy it builds a fresh model from ``model_factory`` under the same seed (so
every strategy starts from identical weights), applies the strategy, measures
one training step exactly with :func:`remat.measure.profile`, and checks the
gradients against the un-checkpointed model with :func:`remat.validate`.
Step times are then taken side by side (see Note [ Interleaved timing ]).

# NOTE [ Interleaved timing ]
# Timing each strategy in its own block of repeats lets drift (CPU frequency
# scaling, a noisy neighbour, allocator warm-up) land on one strategy and not on
# the others, which biases the step-time ratio. compare() instead keeps all
# applied models alive and runs one step of each per round, rotating the order
# every round, then takes the median per strategy. The ratios therefore compare
# steps measured within the same few seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from remat.core.rows import BASELINE, ComparisonResult, StrategyRow
from remat.errors import message

_BASELINE = BASELINE

ProgressFn = Callable[[str, int, int], None]
"""``progress(description, completed, total)``, called before and after each unit of work."""


def compare(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    strategies: Sequence[str] | None = None,
    *,
    blocks: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    seed: int = 0,
    repeats: int = 5,
    check_grads: bool = True,
    label: str = "",
    meta: Mapping[str, Any] | None = None,
    progress: ProgressFn | None = None,
) -> ComparisonResult:
    """Measure peak memory, recompute FLOPs, step time and gradient parity per strategy.

    Checkpointing trades compute for memory; this puts numbers on both sides of
    the trade for one model and batch: exact peak and activation bytes, the FLOPs
    spent recomputing (relative to the baseline's total FLOPs), and the median
    step-time ratio against ``"none"``, plus a gradient check per strategy.

    Warning:
        All applied models stay alive until timing ends (one per strategy), so the
        run needs about ``len(strategies)`` times the model's parameter memory.
        Pass ``repeats=0`` to skip timing and keep only one model at a time.

    Args:
        model_factory: builds a fresh model on the target device, in train mode.
            Called once per strategy (and by the gradient check) after
            ``torch.manual_seed(seed)``, so it must be deterministic given the seed.
        batch: the model input: a tensor, tuple, or dict (passed as ``model(**batch)``).
        strategies: strategy strings (see :data:`remat.strategies.STRATEGIES`). The
            baseline ``"none"`` is added first when missing. Default:
            ``default_strategies("compare")`` from the strategy registry, read at call time.
        blocks: which modules are blocks (class, classes, or predicate). Default: found.
        loss_fn: ``loss_fn(output, batch) -> Tensor``. Default: ``output.loss`` if
            present, else the first element of a tuple output, else the mean output.
        seed: the seed set before every model build. Default: ``0``.
        repeats: timed steps per strategy; ``0`` skips timing. Default: ``5``.
        check_grads: run :func:`remat.validate` per strategy. Default: ``True``.
        label: free text stored on the result (titles of tables and plots).
        meta: extra JSON-able facts stored on the result.
        progress: called as ``progress(description, completed, total)`` as work proceeds.

    Returns:
        A :class:`ComparisonResult` with one row per strategy, baseline first.

    Raises:
        ValueError: ``strategies`` is empty, has duplicates, or ``repeats < 0``.
        remat.errors.StrategyError: an unknown strategy (raised by ``remat.strategies``).

    Example:
        >>> from remat.models import build_model, make_batch
        >>> model = build_model("gpt-tiny")
        >>> result = compare(lambda: build_model("gpt-tiny"), make_batch(model, 2),
        ...                  ["none", "full"], repeats=1)
        >>> result.row("full").activation_bytes < result.row("none").activation_bytes
        True
    """
    from remat.blocks import named_blocks
    from remat.measure import profile as measure_profile
    from remat.strategies import apply

    names = _normalize_strategies(strategies)
    if repeats < 0:
        raise ValueError(message("remat.compare", "repeats must be >= 0", {"found": repeats},
                                 fix="pass repeats >= 0 (0 skips timing)"))

    total = len(names) * (2 if check_grads else 1) + repeats
    done = 0

    def tick(description: str, advance: int = 0) -> None:
        nonlocal done
        done += advance
        if progress is not None:
            progress(description, done, total)

    profiles: dict[str, Any] = {}
    reports: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    device = "cpu"
    for name in names:
        tick(f"profile {name}")
        model = _fresh_model(model_factory, seed)
        device = _model_device(model)
        named_blocks(model, blocks, api="remat.compare")  # bad blocks= fail naming this call
        apply(model, name, blocks=blocks)
        profiles[name] = measure_profile(model, batch, loss_fn=loss_fn, blocks=blocks,
                                         timing=False)
        model.zero_grad(set_to_none=True)
        if repeats:
            models[name] = model
        else:
            del model
        tick(f"profile {name}", 1)
        if check_grads:
            tick(f"check gradients {name}")
            reports[name] = _check_grads(model_factory, seed, batch, name, blocks, loss_fn)
            tick(f"check gradients {name}", 1)

    step_ms: dict[str, float | None] = dict.fromkeys(names)
    if repeats:
        step_ms.update(_interleaved_step_ms(models, batch, loss_fn, repeats, tick))
    models.clear()

    base = profiles[_BASELINE]
    base_ms = step_ms[_BASELINE]
    rows = []
    for name in names:
        prof = profiles[name]
        report = reports.get(name)
        ms = step_ms[name]
        rows.append(StrategyRow.from_profile(name, prof, base, step_ms=ms, base_ms=base_ms,
                                             report=report))
    return ComparisonResult(rows=tuple(rows), device=device, repeats=repeats, label=label,
                            meta=dict(meta or {}))


def compare_preset(
    preset: str,
    batch_size: int = 8,
    seq_len: int | None = None,
    strategies: Sequence[str] | None = None,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
    repeats: int = 5,
    check_grads: bool = True,
    progress: ProgressFn | None = None,
) -> ComparisonResult:
    """:func:`compare` on a built-in model preset with a random token batch.

    Args:
        preset: a key of :data:`remat.models.PRESETS`, e.g. ``"gpt-small"``.
        batch_size: sequences per batch. Default: ``8``.
        seq_len: tokens per sequence. Default: the preset's ``max_seq_len``.
        strategies: as in :func:`compare`. Default: ``default_strategies("compare")``.
        device: where to build the models and batch. Default: CUDA when available, else CPU.
        seed: seed for the weights and the batch. Default: ``0``.
        repeats: timed steps per strategy. Default: ``5``.
        check_grads: run the gradient check. Default: ``True``.
        progress: as in :func:`compare`.

    Returns:
        The :class:`ComparisonResult`, labelled ``"<preset>, batch <B>, seq <T>"`` with
        ``meta`` holding ``model``, ``batch_size``, ``seq_len``, ``seed`` and ``torch``.

    Raises:
        ValueError: unknown preset, or a batch size / sequence length the preset cannot take.

    Example:
        >>> compare_preset("gpt-tiny", 2, strategies=["none", "full"]).row("full").strategy
        'full'
    """
    from remat.models import build_model, make_batch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    batch = make_batch(preset, batch_size, seq_len, seed=seed, device=target)
    tokens = int(batch["input_ids"].shape[1])

    def factory() -> nn.Module:
        with target:
            return build_model(preset)

    meta = {"model": preset, "batch_size": batch_size, "seq_len": tokens, "seed": seed,
            "torch": torch.__version__}
    return compare(factory, batch, strategies, seed=seed, repeats=repeats,
                   check_grads=check_grads, label=f"{preset}, batch {batch_size}, seq {tokens}",
                   meta=meta, progress=progress)


def _normalize_strategies(strategies: Sequence[str] | None) -> list[str]:
    from remat.strategies.registry import default_strategies, parse_strategy

    if strategies is None:
        strategies = default_strategies("compare")
    if isinstance(strategies, str):
        strategies = [s.strip() for s in strategies.split(",") if s.strip()]
    names = [s.strip() for s in strategies]
    for name in names:
        parse_strategy(name, api="remat.compare")  # an unknown one fails before any work
    if not names:
        raise ValueError(message("remat.compare", "strategies must not be empty",
                                 fix=f"pass strategies such as {default_strategies('compare')}"))
    duplicates = sorted({s for s in names if names.count(s) > 1})
    if duplicates:
        raise ValueError(message("remat.compare", "strategies listed twice",
                                 {"found": duplicates}, fix="list each strategy once"))
    if _BASELINE not in names:
        names.insert(0, _BASELINE)
    return names


def _fresh_model(model_factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = model_factory()
    model.train()
    return model


def _model_device(model: nn.Module) -> str:
    for param in model.parameters():
        return str(param.device)
    return "cpu"


def _check_grads(model_factory: Callable[[], nn.Module], seed: int, batch: Any, strategy: str,
                 blocks: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Any:
    from remat.validation import validate

    model = _fresh_model(model_factory, seed)
    return validate(model, batch, strategy, blocks=blocks, loss_fn=loss_fn)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _train_step_ms(model: nn.Module, batch: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> float:
    from remat.measure import run_step

    device = _model_device(model)
    _synchronize(device)
    start = time.perf_counter()
    run_step(model, batch, loss_fn=loss_fn)
    _synchronize(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    model.zero_grad(set_to_none=True)
    return elapsed_ms


def _interleaved_step_ms(models: Mapping[str, nn.Module], batch: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor] | None, repeats: int,
                         tick: Callable[[str, int], None]) -> dict[str, float | None]:
    # See Note [ Interleaved timing ].
    names = list(models)
    samples: dict[str, list[float]] = {name: [] for name in names}
    # No warm-up round: every model already ran profile()'s warm-up and tracked steps,
    # and the median drops a slow first round.
    for round_index in range(repeats):
        description = f"time steps (round {round_index + 1}/{repeats})"
        tick(description, 0)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_train_step_ms(models[name], batch, loss_fn))
        tick(description, 1)
    return {name: statistics.median(values) for name, values in samples.items()}
