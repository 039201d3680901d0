"""The peak model window by window: predicted vs measured for the planner's first choice.

Diagnoses the peak model's error (NOTE [ Peak model ] in src/remat/core/peak.py). For a
preset model in a precision, a device budget a fraction of the way from ``full``'s peak to
``none``'s (one device, AdamW), it prepares the planner's context, solves the budget
once, applies that choice to the context's fake copy and runs one tracked step cut into
memory windows (NOTE [ Memory windows ] in measure/windows.py); then prints each window whose
measured peak differs from the prediction, and the choice.

Finding (2026-11-22, session 5): under bf16 the error grew by one bf16 hidden state per
block before the window whose blocks keep their input (checkpointed blocks: ``full`` and
block-wide ``ops``). A block's measured saved bytes counted its *output* (``run_block``'s
"saved" window started with the output alive) and never its input; in the whole step that
tensor is kept only if the next block keeps its input. Un-checkpointed bf16 Llama blocks
keep only the fp32 upcast of their input (RMSNorm), so the calibration on ``none``
subtracted the hidden states that checkpointed blocks really keep: llama-small, seq 128,
batch 8, 25%: 512 KiB per block, 3 MiB at the head window; Llama-7B, seq 2048, batch 8:
128 MiB per block, 4 GiB. In fp32 the norm keeps its input itself and the error was 0.

Fixed (same day): ``run_block`` now attributes a hidden state to the block whose graph
keeps it (NOTE [ Who keeps a hidden state ] in block_run.py), and a ``gap:i`` window no
longer counts the moment it opens, when the caller still holds block i's input (NOTE [ Gap
windows ] in measure/windows.py). Every window is now exact for llama-small and gpt-small in
fp32 and bf16 (fractions 0.1 to 0.8 checked on llama-small bf16).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/peak_windows.py --model llama-small --dtype bf16
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

from remat.device_memory import OutsideMemory, Workspaces
from remat.devices import DeviceSpec
from remat.models import build_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-small", help="preset (default llama-small)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--dtype", default="bf16", help="precision (default bf16)")
    parser.add_argument("--fraction", type=float, default=0.25,
                        help="budget: this fraction of the way from full to none (0.25)")
    args = parser.parse_args(argv)

    import remat.planning.planner as planner
    from remat.core.solver import solve
    from remat.measure.step import clear_grads
    from remat.measure.windows import run_windows
    from remat.simulate import simulate
    from remat.strategies import apply_decisions, remove
    from remat.strategies.apply import quiet_warnings

    class Done(Exception):
        pass

    def report(step: Any, ctx: Any, budget_bytes: int, **_: Any) -> Any:
        model = ctx.peak_model
        choice = solve(model, budget_bytes)
        if choice is None:
            print("no choice fits the budget")
            raise Done
        setup, decisions = ctx.setup, ctx.decisions(choice)
        with quiet_warnings(), setup.mode:
            apply_decisions(setup.model, decisions, blocks=step.blocks)
            clear_grads(setup.model)
        try:
            measured = run_windows(setup, loss_fn=step.loss_fn)
        finally:
            remove(setup.model)
        predicted = model.window_bytes(choice)
        print(f"{'window':10s} {'measured':>14s} {'predicted':>14s} {'error':>12s}")
        for label in measured.order:
            error = measured.peaks[label] - predicted.get(label, 0)
            if error:
                print(f"{label:10s} {measured.peaks[label]:14,d} {predicted.get(label, 0):14,d} "
                      f"{error:+12,d}")
        print("choice:", dict(collections.Counter(model.tables[i][c].label()
                                                  for i, c in enumerate(choice))))
        raise Done

    def factory() -> Any:
        return build_model(args.model)

    kwargs: dict[str, Any] = dict(seq_len=args.seq, batch_sizes=[args.batch], dtype=args.dtype)
    probe = simulate(factory, strategies=["none", "full"], device="l4", **kwargs)
    low = probe.row("full", args.batch).single_device_peak_bytes
    high = probe.row("none", args.batch).single_device_peak_bytes
    device = DeviceSpec("budget", int(low + args.fraction * (high - low)), 1e12, 1e11, 1e11, 1e9)
    close_loop = planner.close_loop
    planner.close_loop = report  # type: ignore[assignment]  # stop after the first choice
    try:
        # the budget is on allocated bytes: the card is this benchmark's budget, not a GPU
        simulate(factory, strategies=["none"], device=device, plan=True, exact=True,
                 fits_on="allocated", outside=OutsideMemory(context_bytes=0, nccl_bytes=0),
                 workspaces=Workspaces(cublas_bytes=0, cublaslt_bytes=0, cudnn_bytes=0),
                 **kwargs)
    except Done:
        return 0
    finally:
        planner.close_loop = close_loop
    print(f"nothing was planned: none's peak ({high:,d} B) fits the budget, or full's "
          f"({low:,d} B) is the same (the optimizer step's moment); use a larger batch")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
