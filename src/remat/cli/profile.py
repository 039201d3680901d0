"""``remat profile``: one training step of one strategy, block by block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from remat.cli import app
from remat.cli.common import (
    check_fits,
    err_console,
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
    _check_strategies,
    check_output,
)
from remat.cli.sources import (
    batch_shape,
    given_flags,
    given_sources,
    run_source,
    shape_label,
)
from remat.errors import message

_EPILOG = """\
Examples:

  remat profile

  remat profile --model llama-small --strategy full --batch 4

  remat profile --model gpt-tiny --strategy ops --optimizer adamw --json out/profile.json

  remat profile --trace out/trace.json   (open it in https://ui.perfetto.dev)

  remat profile --batch 2 --optimizer adamw --timeline out/memory.png --timeline-with full

  remat profile --module examples/my_model.py:build --batch 2 --seq 64   (your own model)

  remat profile --hf llama --set num_hidden_layers=2 --set hidden_size=256 --seq 64
"""


@app.command("profile", epilog=_EPILOG, cls=RegistryHelpCommand)
def profile_command(
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
    optimizer: OptimizerOpt = OptimizerChoice.none,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Timed steps (median) for forward and backward times.",
    )] = 5,
    seed: SeedOpt = 0,
    json_out: JsonOpt = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="FILE.json", dir_okay=False, callback=check_output,
        help="Export a torch.profiler Chrome trace of one step (open in Perfetto).",
    )] = None,
    timeline: Annotated[Path | None, typer.Option(
        "--timeline", metavar="FILE.png", dir_okay=False, callback=check_output,
        help="Draw live bytes over the step's ops, stacked by category, phases shaded, the "
             "peak annotated.")] = None,
    timeline_with: Annotated[str | None, typer.Option(
        "--timeline-with", callback=_check_strategies, metavar="A,B",
        help="Strategies drawn beside --strategy in the --timeline picture.",
    )] = None,
) -> None:
    """Measure one training step of a model under one strategy.

    Prints the per-block table (bytes saved for backward, forward FLOPs and time),
    the memory totals by category, and the backward/forward time ratio: about 2
    without checkpointing, higher when blocks are recomputed during backward.
    The model is a preset, a Hugging Face config or your own (--module).
    """
    import torch

    from remat.measure import profile as measure_profile
    from remat.report.tables import blocks_table, totals_table
    from remat.strategies import apply

    sources = given_sources(model, hf, hf_config, module, settings)
    target = resolve_device(device)
    source = run_source(sources, api="remat profile", seq=seq, seed=seed, target=target,
                        given=given_flags(ctx, "batch", "seq"))
    name = source.name
    check_fits(name, source.param_bytes, target,
               copies=2 if optimizer is OptimizerChoice.none else 4)
    sample = source.batch(batch)
    batch_size, seq_len = batch_shape(sample)

    with user_errors(), notices(), progress_bar(f"profile {name} ({strategy})") as update:
        update("build model", 0, 3)
        net = source.build()
        apply(net, strategy)
        opt = make_optimizer(optimizer.value, net)
        update("measure step", 1, 3)
        result = measure_profile(net, sample, optimizer=opt, repeats=repeats,
                                 loss_fn=source.loss_fn)
        update("trace" if trace else "done", 2, 3)
        if trace is not None:
            export_trace(net, sample, trace, optimizer=opt, loss_fn=source.loss_fn)
        if timeline is not None:
            from remat.report.timeline import plot_timeline

            shown = [(strategy, result)]
            for other in timeline_with.split(",") if timeline_with else []:
                apply(net, other)
                shown.append((other, measure_profile(net, sample, optimizer=opt, timing=False,
                                                     loss_fn=source.loss_fn)))
            label = shape_label(name, batch_size, seq_len)
            plot_timeline([p for _, p in shown], timeline,
                          titles=[f"{label}, {s}" for s, _ in shown])
        update("done", 3, 3)

    meta = {"model": name, "batch_size": batch_size, "seq_len": seq_len, "strategy": strategy,
            "optimizer": optimizer.value, "seed": seed, "torch": torch.__version__}
    if json_out != "-":
        console = stdout_console()
        title = f"remat profile: {shape_label(name, batch_size, seq_len)}, strategy " \
                f"{strategy} on {result.device}"
        console.print(blocks_table(result, title=title))
        console.print(totals_table(result))
        from remat.report.tables import backward_forward_ratio

        ratio = backward_forward_ratio(result)
        if ratio is not None:
            console.print(
                f"Backward/forward time ratio: {ratio:.2f} "
                "(about 2 without checkpointing; recomputation adds forward work to backward)",
                highlight=False,
            )
    if trace is not None:
        err_console.print(f"Wrote {trace} (open it in https://ui.perfetto.dev)", highlight=False)
    if timeline is not None:
        err_console.print(f"Wrote {timeline}", highlight=False)
    if json_out is not None:
        write_json({**meta, **profile_to_dict(result)}, json_out)


def profile_to_dict(result: Any) -> dict[str, Any]:
    """A JSON-able dict of a :class:`remat.measure.Profile`: totals, blocks, and ops by kind.

    Ops are aggregated by ``(name, phase)`` (count, FLOPs, bytes read and written),
    which keeps the output small on large models.
    """
    from remat.report.tables import backward_forward_ratio

    totals = {
        key: getattr(result, key)
        for key in ("peak_bytes", "activation_bytes", "param_bytes", "buffer_bytes",
                    "grad_bytes", "optimizer_bytes", "batch_bytes", "flops", "forward_flops",
                    "backward_flops", "recompute_flops", "forward_ms", "backward_ms", "step_ms",
                    "simulated", "device", "allocator_peak_bytes")
    }
    blocks = [
        {"name": b.name, "saved_bytes": b.saved_bytes, "forward_flops": b.forward_flops,
         "forward_ms": b.forward_ms}
        for b in result.blocks
    ]
    ops: dict[tuple[str, str], dict[str, Any]] = {}
    for op in result.ops:
        entry = ops.setdefault((op.name, op.phase), {
            "name": op.name, "phase": op.phase, "count": 0, "flops": 0, "read_bytes": 0,
            "write_bytes": 0,
        })
        entry["count"] += 1
        entry["flops"] += op.flops
        entry["read_bytes"] += op.read_bytes
        entry["write_bytes"] += op.write_bytes
    return {**totals, "backward_forward_ratio": backward_forward_ratio(result),
            "blocks": blocks, "ops": sorted(ops.values(), key=lambda e: -e["flops"])}


def export_trace(model: Any, batch: Any, path: str | Path, *, optimizer: Any = None,
                 loss_fn: Callable[[Any, Any], Any] | None = None) -> Path:
    """Run one training step under :mod:`torch.profiler` and write a Chrome trace.

    The trace (JSON with ``traceEvents``) opens in https://ui.perfetto.dev or
    chrome://tracing; forward, backward and the optimizer step are marked with
    ``record_function`` ranges (``remat.forward``, ``remat.backward``,
    ``remat.optimizer``). CUDA kernels are included when the model is on CUDA.

    Args:
        model: the (already checkpointed) model.
        batch: its input (tensor, tuple, or dict passed as ``model(**batch)``).
        path: output JSON file; parent directories are created.
        optimizer: stepped after backward when given. Default: ``None``.
        loss_fn: ``loss_fn(output, batch)``. Default: as in :func:`remat.measure.profile`.

    Returns:
        The path written.
    """
    import torch
    from torch.profiler import ProfilerActivity, record_function

    from remat.measure import run_step
    from remat.measure.allocator import no_cycle_warning
    from remat.native import silenced

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    ranges: list[Any] = []

    def on_phase(phase: str) -> None:
        # One record_function range per phase: forward (with the loss), backward, optimizer.
        while ranges:
            ranges.pop().__exit__(None, None, None)
        if phase != "end":
            ranges.append(record_function(f"remat.{phase}"))
            ranges[-1].__enter__()

    model.zero_grad(set_to_none=True)
    prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                  profile_memory=True)
    # kineto prints "USDT ... profiler_start" lines on stderr
    with silenced(2), no_cycle_warning():
        prof.__enter__()
    try:
        try:
            run_step(model, batch, loss_fn=loss_fn, optimizer=optimizer, on_phase=on_phase)
        finally:
            on_phase("end")
        if on_cuda:
            torch.cuda.synchronize()
    finally:
        with silenced(2):
            prof.__exit__(None, None, None)
    prof.export_chrome_trace(str(out))
    model.zero_grad(set_to_none=True)
    if not out.is_file() or out.stat().st_size == 0:  # the exporter does not raise on failure
        raise OSError(message("remat profile", f"the trace was not written to {str(out)!r}",
                              fix="choose a writable path for --trace"))
    return out
