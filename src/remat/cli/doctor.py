"""``remat doctor``: run a job's training steps and say why its memory grows, or read a CUDA
memory snapshot and say why it ran out (exit 1 when it grows or ran out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from remat.cli import app
from remat.cli.common import (
    check_fits,
    fail,
    make_optimizer,
    notices,
    progress_bar,
    resolve_device,
    stdout_console,
    user_errors,
    write_json,
)
from remat.cli.options import (
    BatchOpt,
    DeviceOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    ModelOpt,
    ModuleOpt,
    OptimizerChoice,
    OptimizerOpt,
    RegistryHelpCommand,
    SeedOpt,
    SeqOpt,
    SetOpt,
    StrategyOpt,
)
from remat.cli.sources import batch_shape, given_flags, given_sources, run_source, shape_label
from remat.cli.user_model import FORMS, load_attribute, raised
from remat.errors import RematError, message

_API = "remat doctor"
_EPILOG = """\
Examples:

  remat doctor --model gpt-tiny --batch 2

  remat doctor --module train.py:build --train-step train.py:train_step

  remat doctor --model gpt-tiny --no-zero-grad   (a loop that never clears gradients)

  remat doctor --snapshot oom.pickle   (torch.cuda.memory._dump_snapshot)

Exit code: 0 healthy, 1 memory grows or the snapshot ran out of memory, 2 bad input.
"""


def _load_step(spec: str) -> Callable[..., Any]:
    """The function ``--train-step FILE.py:NAME`` (or ``module:NAME``) names."""
    step, _, _ = load_attribute(spec, _API, option="--train-step")
    target, name = spec.rpartition(":")[::2]
    if not callable(step):
        fail(message(_API, f"--train-step {spec}: {target} has no function {name!r}",
                     {"expected": FORMS},
                     fix=f"define def {name}(model, batch): ... (your training step)"))
    return step  # type: ignore[no-any-return]


@app.command("doctor", epilog=_EPILOG, cls=RegistryHelpCommand)
def doctor_command(
    ctx: typer.Context,
    model: ModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    module: ModuleOpt = None,
    settings: SetOpt = None,
    batch: BatchOpt = 8,
    seq: SeqOpt = None,
    strategy: StrategyOpt = "none",
    device: DeviceOpt = "auto",
    optimizer: OptimizerOpt = OptimizerChoice.adamw,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, help="Training steps to run (3 or more to see growth).")] = 4,
    train_step: Annotated[str | None, typer.Option(
        "--train-step", metavar="FILE.py:FUNC",
        help="Your own training step, FUNC(model, batch) or FUNC(model, batch, optimizer) "
             "(--optimizer's): forward, loss, backward, optimizer, and whatever your loop "
             "keeps. Default: remat's step.")] = None,
    no_zero_grad: Annotated[bool, typer.Option(
        "--no-zero-grad", help="Run remat's step as a loop that never calls zero_grad.",
    )] = False,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", metavar="FILE.pickle", exists=True, dir_okay=False,
        help="A CUDA memory snapshot (torch.cuda.memory._dump_snapshot) to explain: its "
             "peak and out-of-memory event. Alone, no model is run.")] = None,
    seed: SeedOpt = 0,
    json_out: JsonOpt = None,
) -> None:
    """Say why a job's memory grows, or why it ran out.

    Runs --steps training steps of the model (a preset, --hf, --hf-config or --module,
    with --train-step for your own loop's step) and prints each step's peak, what is
    alive at it by category and by block, and what grows between steps with what holds
    it: gradients never cleared, tensors your loop keeps, module state growing (in
    recomputation too), reserved bytes growing on the CUDA caching allocator. With
    --snapshot it explains a CUDA memory snapshot: the peak, an out-of-memory event, and
    whether a plan, a smaller shape or expandable segments fix it. Exits 1 when memory
    grows or the snapshot ran out.
    """
    import torch

    from remat.measure.doctor import doctor
    from remat.report.doctor import doctor_renderables
    from remat.strategies import apply

    run_model = any(v is not None for v in (model, hf, hf_config, module)) or snapshot is None
    if train_step is not None and no_zero_grad:
        fail("--no-zero-grad changes remat's step; --train-step runs yours (clear the "
             "gradients in it, or not)")
    meta: dict[str, Any] = {"steps": steps, "torch": torch.__version__}
    title = f"remat doctor: snapshot {snapshot}" if snapshot is not None else "remat doctor"
    net = sample = opt = step_fn = source = data = None
    if snapshot is not None:
        from remat.core.snapshot import load_snapshot

        try:
            data = load_snapshot(snapshot)
        except ValueError as exc:
            fail(str(exc).replace("remat.doctor:", "--snapshot:", 1))
    if run_model:
        sources = given_sources(model, hf, hf_config, module, settings)
        target = resolve_device(device)
        source = run_source(sources, api=_API, seq=seq, seed=seed, target=target,
                            given=given_flags(ctx, "batch", "seq"))
        check_fits(source.name, source.param_bytes, target,
                   copies=1 if optimizer is OptimizerChoice.none else 2)
        sample = source.batch(batch)
        batch_size, seq_len = batch_shape(sample)
        step_fn = _load_step(train_step) if train_step is not None else None
        title = f"remat doctor: {shape_label(source.name, batch_size, seq_len)}, strategy " \
                f"{strategy}, {steps} steps on {target}"
        meta.update({"model": source.name, "batch_size": batch_size, "seq_len": seq_len,
                     "strategy": strategy, "optimizer": optimizer.value,
                     "train_step": train_step, "zero_grad": not no_zero_grad})
    with user_errors(), notices(), progress_bar("doctor") as update:
        if source is not None:
            update("build model", 0, 2)
            net = source.build()
            apply(net, strategy)
            opt = make_optimizer(optimizer.value, net)
            update(f"run {steps} steps", 1, 2)
        try:
            report = doctor(net, sample, loss_fn=None if step_fn is not None
                            else source.loss_fn if source is not None else None,
                            optimizer=opt, step_fn=step_fn, steps=steps,
                            zero_grad=not no_zero_grad, snapshot=data)
        except Exception as exc:
            if step_fn is None or isinstance(exc, RematError) or \
                    str(exc).startswith("remat.doctor:"):
                raise
            raised(_API, f"--train-step {train_step}: the step raised an error", exc,
                   fix="fix the step (call it in Python to see the whole traceback)")
        update("done", 2, 2)
    if json_out != "-":
        console = stdout_console()
        for part in doctor_renderables(report, title=title):
            console.print(part)
    if json_out is not None:
        write_json({**meta, **report.to_dict()}, json_out)
    if not report.healthy:
        raise typer.Exit(1)
