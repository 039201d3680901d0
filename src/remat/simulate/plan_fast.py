"""The fast path of the ``"plan"`` rows: the planner's parts from shallow steps, the row composed.

NOTE [ Fast plan rows ]
The exact plan row (NOTE [ Planner hook ] in planned_rows.py) runs the planner once per
batch size: a fake copy, every candidate measured (about 30 block runs for Llama),
one whole step cut into memory windows, then a whole tracked step of the chosen plan
(the closed loop), whose profile is the row. For a uniform stack (the condition of
NOTE [ Fast rows ] in fast_rows.py) and sharding ``"none"`` or ``"ddp"`` the same peak
model is built from cheaper parts, and the row is composed instead of measured:

1. *Candidates* depend on a block and its inputs, not on the depth: they are measured
   on the stack cut to two blocks, at the smallest and the largest batch size that
   needs a plan. A size between gets every block run interpolated (both ends' runs
   peak at the same moments, NOTE [ Peak moments ] in measure/windows.py; each op's
   FLOPs and bytes are affine in ``b``), and the planner's own selection (offers,
   attention+MLP pairs, pruning) runs on the interpolated runs
   (``measure_groups(run=...)``); a run that does not line up (gpt-tiny in fp32: a
   candidate whose backward peaks in recompute at batch 4 and after it at 16), or that
   the selection at that size asks for and the ends lack, is measured at that size.
2. *Windows*: NOTE [ Windows from shallow steps ] in plan_windows.py; the fast
   rows' warm fake copy (NOTE [ Fast rows ] 4) is cut in place to each shallow depth
   (``_Shallow``), at every size.
3. *The row*: the peak model is the exact path's (same candidates, same windows), so
   the solver picks the same choice. The peak model reproduces a measured step's
   peak to the byte (NOTE [ Peak model ]; Llama-7B bf16 at batch 4 to 32: the closed
   loop's measured peak equals the prediction), so the peak is the prediction, and
   its phase is the phase at that window's peak (in a block's backward window, the
   chosen candidate's). The step is the ``"none"`` row at that size plus what the
   chosen candidates recompute: FLOPs, roofline time (the forward, backward and
   optimizer ops are the same under any plan), and activations less what the
   candidates do not keep. A size no choice fits gets the smallest predicted peak,
   which is what the closed loop would measure.
4. *Confirmed*: the peak model is exact where a block's candidates measured on their
   own behave as in the step. Under autocast they do not (the block runs run outside
   the autocast region), and the exact path's closed loop measures and corrects
   (tightening, or no plan). So the prediction is checked on fake steps of the warm
   copy of item 2, each running up to four distinct candidates in the order the
   choices use them (on two to four blocks, the last repeated), against the peak
   model of that depth; a mismatch sends the sizes concerned to the exact path.
   Whether a candidate's numbers add up in the step is a property of the program, the
   same at every batch size above 1 (NOTE [ Peak moments ]), so every candidate any
   size chose is checked once, at the largest size; a size whose choices were not
   all measured there is checked on its own. Autocast, which fails the check
   (tests/simulate/test_plan_fast.py), goes to the exact path without trying.

Anything else (FSDP, which plans in rounds against a tightened budget, stacks that
are not uniform or too short, windows off the pattern, no ``"none"`` row) takes the
exact path, per batch size where only that size fails; ``simulate(..., exact=True)``
always does. tests/simulate/test_plan_fast.py compares the two row by row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from remat.core.cost import Category
from remat.core.peak import PeakModel
from remat.measure.windows import FakeSetup, StepWindows
from remat.planning.block_run import BlockRun, run_block
from remat.planning.candidates import BlockGroup, Candidate
from remat.simulate.fast_rows import FastContext, _cut
from remat.simulate.plan_windows import SHALLOW, deepen_windows, interpolate_windows, mix_run
from remat.simulate.point import card_fit, fit_note
from remat.simulate.result import SimulationRow
from remat.simulate.samples import NotAffine
from remat.simulate.sim_setup import Setup

_CANDIDATE_DEPTH = 2  # blocks the stack is cut to for measuring candidates

#: ``(budget_bytes, no_plan)``: ``no_plan(batch_size, min_peak_bytes)`` is the row of a
#: batch size no plan fits.
Budget = tuple[int, Callable[[int, int], SimulationRow]]


def _split(sizes: Sequence[int]) -> tuple[list[int], list[int], tuple[int, int]]:
    """``(measured, between, ends)``: batch size 1 (off the line, NOTE [ Fast rows ] 4) and
    the smallest and largest other size are measured, the sizes between interpolated."""
    rest = sorted(b for b in sizes if b != 1)
    ends = (rest[0], rest[-1]) if rest else (1, 1)
    if len(rest) <= 2:
        return sorted(sizes), [], ends
    return [*(b for b in sizes if b == 1), *ends], rest[1:-1], ends


@contextmanager
def _fake_cut(ctx: FastContext, depth: int, *,
              optimizer: bool) -> Iterator[tuple[Setup, FakeSetup]]:
    """A fake copy of the model with its stack cut to ``depth`` blocks."""
    from remat.planning.context import fake_setup

    assert ctx.stack is not None
    with _cut(ctx.setup, ctx.stack, depth) as cut:
        yield cut, fake_setup(cut.model, None, optimizer=cut.optimizer if optimizer else None,
                              blocks=cut.blocks)


def _rebatch(fake: FakeSetup, cut: Setup, batch_size: int, seq_len: int) -> None:
    from remat.measure.fake import fake_batch

    fake.batch = fake_batch(cut.batch_fn(batch_size, seq_len), fake.fake_mode)


class _Shallow:
    """The fast rows' warm fake copy (:meth:`FastContext.warm_copy`), its stack cut to each
    :data:`SHALLOW` depth in place (NOTE [ Fast plan rows ] 2): each depth's optimizer
    keeps the warm state of the parameters left, which is what a warm-up at that depth
    creates."""

    def __init__(self, ctx: FastContext, seq_len: int, first: int) -> None:
        self.ctx, self.cut, self.device = ctx, ctx.setup, ctx.setup.device
        self._seq_len, self._first = seq_len, first

    @contextmanager
    def at(self, depth: int) -> Iterator[FakeSetup]:
        """The copy with its stack cut to ``depth`` blocks."""
        from remat.blocks import named_blocks
        from remat.measure.step import model_device

        with self.ctx.warm_copy(depth, self._seq_len, self._first) as (warm, on_copy, _):
            named = named_blocks(warm.model, self.cut.blocks, api="remat.plan")
            yield FakeSetup(warm.mode, warm.model, None, on_copy.optimizer, named,
                            model_device(warm.model))

    def windows(self, fake: FakeSetup, batch_size: int, seq_len: int) -> StepWindows:
        """One windows step of ``fake`` (from :meth:`at`) at ``batch_size``."""
        from remat.measure.windows import run_windows

        _rebatch(fake, self.cut, batch_size, seq_len)
        return run_windows(fake, loss_fn=self.cut.loss_fn, warm_up=False)


def _windows(ctx: FastContext, shallow: _Shallow, sizes: Sequence[int],
             seq_len: int) -> dict[int, dict[int, StepWindows]]:
    """Per size, the windows of steps of the stack cut to each :data:`SHALLOW` depth (NOTE
    [ Fast plan rows ] 2)."""
    measured, between, ends = _split(sizes)
    steps: dict[int, dict[int, StepWindows]] = {b: {} for b in sizes}
    for depth in reversed(SHALLOW):  # the deepest first: its warm-up serves all
        with shallow.at(depth) as fake:
            for b in measured:
                steps[b][depth] = shallow.windows(fake, b, seq_len)
            for b in between:
                try:
                    steps[b][depth] = interpolate_windows(
                        steps[ends[0]][depth], steps[ends[1]][depth], ends, b)
                except NotAffine:
                    steps[b][depth] = shallow.windows(fake, b, seq_len)
    return steps


Runs = dict[int, dict[Any, BlockRun]]
"""Per measured batch size, its block runs by candidate parts."""


def _candidates(ctx: FastContext, sizes: Sequence[int],
                seq_len: int) -> tuple[dict[int, tuple[Candidate, ...]], Runs]:
    """Every size's candidates for the stack's one kind of block (NOTE [ Fast plan rows ] 1),
    and the runs measured at the ends."""
    from remat.planning.candidates import RunBlock, measure_groups

    measured, between, ends = _split(sizes)
    runs: Runs = {}
    out: dict[int, tuple[Candidate, ...]] = {}
    n_blocks = len(ctx.stack[2]) if ctx.stack is not None else 0
    with _fake_cut(ctx, _CANDIDATE_DEPTH, optimizer=False) as (cut, fake):
        blocks = list(fake.blocks)

        def groups(b: int, run: RunBlock) -> tuple[Candidate, ...]:
            _rebatch(fake, cut, b, seq_len)
            fake.blocks[:] = blocks
            # the dense hull is for models this shallow, not for the cut copy
            found = measure_groups(fake, ctx.setup.device, run=run,
                                   model_blocks=n_blocks)
            if len(found) != 1 or len(found[0].names) != _CANDIDATE_DEPTH:
                raise NotAffine  # not one kind of block after all
            return found[0].candidates

        def recording(b: int) -> RunBlock:
            def run(*args: Any, **kwargs: Any) -> BlockRun:
                result = run_block(*args, **kwargs)
                runs.setdefault(b, {})[tuple(args[4])] = result
                return result
            return run

        def interpolating(b: int) -> RunBlock:
            def run(*args: Any, **kwargs: Any) -> BlockRun:
                key = tuple(args[4])
                try:  # a selection at b asking for a run the ends lack: KeyError
                    return mix_run(runs[ends[0]][key], runs[ends[1]][key], ends, b)
                except (KeyError, NotAffine):
                    return run_block(*args, **kwargs)  # this run measured at b
            return run

        for b in measured:
            out[b] = groups(b, recording(b))
        for b in between:
            out[b] = groups(b, interpolating(b))
    return out, runs


def _confirmed(shallow: _Shallow, seq_len: int,
               todo: Mapping[int, tuple[tuple[Candidate, ...], Mapping[int, StepWindows],
                                        list[Candidate]]]) -> set[int]:
    """The sizes whose choice's peak is confirmed on shallow steps (NOTE [ Fast plan
    rows ] 4); ``todo`` holds per size its candidates, shallow windows and the chosen
    candidate of each block."""
    from remat.blocks import NamedBlocks
    from remat.strategies import trial

    def confirm(b: int, table: tuple[Candidate, ...], steps: Mapping[int, StepWindows],
                chunk: list[Candidate]) -> bool:
        depth = max(SHALLOW[0], len(chunk))
        pick = chunk + [chunk[-1]] * (depth - len(chunk))
        with shallow.at(depth) as fake:
            names = [name for name, _ in fake.blocks]
            model = PeakModel.calibrate([BlockGroup(tuple(names), table)], names,
                                        deepen_windows(steps, depth))
            decisions = {k: v for name, c in zip(names, pick, strict=True)
                         for k, v in c.decisions_for(name).items()}
            with trial(fake.model, decisions, blocks=NamedBlocks(tuple(names))):
                measured = shallow.windows(fake, b, seq_len)
        return measured.peak_bytes == model.predict([table.index(c) for c in pick])

    width = SHALLOW[-1]
    confirmed: set[int] = set()
    for b, (table, steps, chosen) in todo.items():
        distinct = list(dict.fromkeys(chosen))
        if all(confirm(b, table, steps, distinct[i:i + width])
               for i in range(0, len(distinct), width)):
            confirmed.add(b)
    return confirmed


def _confirmed_once(shallow: _Shallow, seq_len: int,
                    candidates: Mapping[int, tuple[Candidate, ...]], runs: Runs,
                    steps: Mapping[int, Mapping[int, StepWindows]],
                    chosen: Mapping[int, list[Candidate]]) -> set[int] | None:
    """Every size confirmed at once (NOTE [ Fast plan rows ] 4): every candidate any size
    chose, at the largest size, where all of them were measured; None where they were not
    (each size is confirmed on its own then)."""
    from remat.planning.candidates import measured_candidate

    if not chosen:
        return set()
    at = max(chosen)
    known = {c.parts: c for c in candidates[at]}
    for key, run in runs.get(at, {}).items():
        found = measured_candidate(key, run, shallow.device, base=runs[at].get(()))
        known.setdefault(found.parts, found)
    union = list(dict.fromkeys(c.parts for cs in chosen.values() for c in cs))
    if () not in known or any(parts not in known for parts in union):
        return None
    picked = [known[parts] for parts in union]
    done = _confirmed(shallow, seq_len, {at: ((known[()], *picked), steps[at], picked)})
    return set(chosen) if done else set()


def _inexact(setup: Setup) -> bool:
    """Whether the peak model is known not to be exact (NOTE [ Fast plan rows ] 4)."""
    return setup.precision.autocast_dtype is not None


def _phase(model: Any, windows: StepWindows, choice: Sequence[int]) -> str | None:
    """The phase at the predicted peak: the first window (in time) holding it."""
    values = model.window_bytes(choice)
    peak = max(values.values())
    label = next(w for w in windows.order if values[w] == peak)
    kind, _, index = label.partition(":")
    if kind == "fwd":
        return "forward"
    if kind == "bwd":
        return str(model.tables[int(index)][choice[int(index)]].backward_peak_phase)
    return windows.phases.get(label)


def _row(setup: Setup, batch_size: int, seq_len: int, static: Mapping[Category, int],
         none: SimulationRow, windows: StepWindows, model: PeakModel,
         choice: Sequence[int]) -> SimulationRow:
    """The plan row composed from the peak model and the ``"none"`` row (NOTE [ Fast plan
    rows ] 3)."""
    from remat.distributed.sharding import shard_peak

    peak = model.predict(choice)
    rank_peak = shard_peak(peak_bytes=peak, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                           total_grad_bytes=static[Category.GRADIENTS], sharding=setup.sharding,
                           world_size=setup.world_size).peak_bytes
    chosen = [model.tables[i][c] for i, c in enumerate(choice)]
    recompute_ms = sum(c.recompute_ms for c in chosen)
    recompute_flops = sum(c.recompute_flops for c in chosen)
    dropped = sum(t[0].saved_bytes - c.saved_bytes for t, c in zip(model.tables, chosen,
                                                                   strict=True))
    step_ms = none.step_ms + recompute_ms
    samples_per_s = batch_size * setup.world_size / (step_ms / 1e3) if step_ms > 0 else 0.0
    cost = dataclasses.replace(
        none.cost, peak_bytes=rank_peak, step_ms=step_ms,
        activation_bytes=none.activation_bytes - dropped, flops=none.flops + recompute_flops,
        recompute_flops=recompute_flops, recompute_ms=recompute_ms)
    # NOTE [ Reserved per rank ]: the none row's reserved overhead at this batch size
    extra = none.reserved_bytes - setup.card.workspace_bytes - none.peak_bytes
    fit = card_fit(setup, rank_peak, extra, None)
    return dataclasses.replace(
        none, strategy="plan", cost=cost, fits=fit.fits,
        samples_per_s=samples_per_s, tokens_per_s=samples_per_s * seq_len,
        single_device_peak_bytes=peak, peak_phase=_phase(model, windows, choice),
        note=fit_note(fit), reserved_bytes=fit.reserved_bytes, margin_bytes=fit.margin_bytes)


def fast_plan_rows(ctx: FastContext, sizes: Sequence[int], seq_len: int,
                   static: Mapping[Category, int], none_rows: Mapping[int, SimulationRow],
                   budget: Budget) -> dict[int, SimulationRow]:
    """The plan rows of ``sizes`` the fast path gives (NOTE [ Fast plan rows ]); the sizes
    left out take the exact path.

    Args:
        static: one device's parameter, gradient and optimizer-state bytes (``static_parts``).
        none_rows: the ``"none"`` rows, per batch size.
        budget: the one-device budget (NOTE [ Per-rank budgets ] in planned_rows.py) and the
            row of a size no choice fits, from its smallest peak.
    """
    from remat.blocks import named_blocks
    from remat.core.solver import min_peak_choice, solve
    from remat.planning.context import check_plannable

    setup = ctx.setup
    sizes = [b for b in sizes if b in none_rows]
    if ctx.stack is None or setup.sharding == "fsdp" or not sizes \
            or len(ctx.stack[2]) <= SHALLOW[-1] or _inexact(setup):
        return {}
    check_plannable(setup.model)  # the exact path's warnings
    try:
        candidates, runs = _candidates(ctx, sizes, seq_len)
    except NotAffine:
        return {}
    shallow = _Shallow(ctx, seq_len, sizes[0])
    steps = _windows(ctx, shallow, sizes, seq_len)
    names = [name for name, _ in named_blocks(setup.model, setup.blocks)]
    budget_bytes, no_plan = budget
    solved: dict[int, tuple[StepWindows, PeakModel, list[int], bool]] = {}
    for b in sizes:
        try:
            windows = deepen_windows(steps[b], len(names))
        except NotAffine:
            continue  # NOTE [ Windows from shallow steps ]: this size takes the exact path
        model = PeakModel.calibrate([BlockGroup(tuple(names), candidates[b])], names, windows)
        # the none row's reserved overhead at this size (NOTE [ Reserved per rank ])
        none = none_rows[b]
        extra = max(none.reserved_bytes - setup.card.workspace_bytes - none.peak_bytes, 0)
        choice = solve(model, budget_bytes - extra)
        fits = choice is not None
        solved[b] = (windows, model, choice if choice is not None else min_peak_choice(model),
                     fits)
    chosen = {b: [model.tables[i][c] for i, c in enumerate(choice)]
              for b, (_, model, choice, _) in solved.items()}
    confirmed = _confirmed_once(shallow, seq_len, candidates, runs, steps, chosen)
    if confirmed is None:
        confirmed = _confirmed(shallow, seq_len, {b: (candidates[b], steps[b], chosen[b])
                                                  for b in solved})
    return {b: _row(setup, b, seq_len, static, none_rows[b], windows, model, choice) if fits
            else no_plan(b, model.predict(choice))
            for b, (windows, model, choice, fits) in solved.items() if b in confirmed}
