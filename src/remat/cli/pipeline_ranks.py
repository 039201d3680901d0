"""``remat simulate --pp P [--dp D] [--tp T [--sp]] --schedule S``: bytes per pipeline rank.

With ``--dp`` the table adds each rank's gathered parameters (NOTE [ FSDP under pipeline
parallelism ] in remat/distributed/pipeline_fsdp.py; ``--reshard-after-forward`` picks
FSDP's ``reshard_after_forward``).

Each strategy's rows are :func:`remat.distributed.pipeline.pipeline_rank_bytes`: one simulated
step (with ``--tp``, tensor-parallel rank 0's, under a fake process group) split into
pipeline chunks and replayed over the schedule (NOTE [ Pipeline rank bytes ]).
The plan per stage is, for each pipeline rank, the strategy with the least recompute among
those whose peak fits the device: each stage its own budget, the same card.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from remat.cli.common import fail, stdout_console, write_json
from remat.errors import message

ProgressFn = Callable[[str, int, int], None]


def check_pp(pp: int, dp: int, world_size: int, microbatches: int | None,
             schedule: str, virtual_stages: int, api: str) -> int:
    """Exit 2 on a combination the pipeline rows do not model; the micro-batch count."""
    from remat.distributed.schedule import SCHEDULES

    if dp > 1 and world_size > 1:
        fail(message(api, "--dp and --world-size both given",
                     {"--dp": dp, "--world-size": world_size,
                      "why": "--world-size is data parallelism of the plain table, --dp that of "
                             "the pipeline / tensor-parallel table"},
                     fix="pass --dp only"))
    if schedule not in SCHEDULES:
        fail(message(api, f"unknown --schedule {schedule!r}",
                     {"schedules": ", ".join(SCHEDULES)}, fix="pass one of those"))
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        fail(message(api, f"--virtual-stages {virtual_stages} needs an interleaved schedule",
                     {"--schedule": schedule}, fix="pass --schedule interleaved-1f1b"))
    m = microbatches if microbatches is not None else 2 * pp
    if m < 1:
        fail(message(api, "--microbatches must be >= 1", {"--microbatches": m},
                     fix="pass --microbatches 8 (for example)"))
    return m


def pp_rows(source: Any, *, name: str, seqs: Sequence[int], batch_sizes: Sequence[int],
            strategies: Sequence[str], pp: int, dp: int, tp: int, sequence_parallel: bool,
            schedule: str, microbatches: int, virtual_stages: int, dtype: str, optimizer: str,
            device: str, reshard_after_forward: bool = False,
            update: ProgressFn | None = None,
            tp_plan: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per sequence length, micro-batch size, strategy and pipeline rank."""
    from remat.card_fit import card_budget
    from remat.device_memory import layout_process_groups
    from remat.distributed.pipeline import pipeline_rank_bytes

    # NOTE [ Fits on the card ]: the rank's allocated peak, workspaces and NCCL included
    # (a pipeline rank's allocations are not replayed through the caching allocator's model)
    card = card_budget(device, process_groups=layout_process_groups(tp=tp, dp=dp, pp=pp))
    rows: list[dict[str, Any]] = []
    total, done = len(seqs) * len(batch_sizes) * len(strategies), 0
    for seq_len in seqs:
        for b in batch_sizes:
            for strategy in strategies:
                if update is not None:
                    update(f"{strategy} seq {seq_len} batch {b}", done, total)
                ranks = pipeline_rank_bytes(
                    source, seq_len=seq_len, batch_size=b, stages=pp,
                    microbatches=microbatches, schedule=schedule,
                    virtual_stages=virtual_stages, tp=tp, sequence_parallel=sequence_parallel,
                    dp=dp, strategy=strategy, dtype=dtype, optimizer=optimizer,
                    device=device, reshard_after_forward=reshard_after_forward,
                    tp_plan=tp_plan)
                done += 1
                for r in ranks:
                    rows.append({"model": name, "seq_len": seq_len, "batch_size": b,
                                 "strategy": strategy, "pp": pp, "dp": dp, "tp": tp,
                                 "sequence_parallel": sequence_parallel, "schedule": schedule,
                                 "microbatches": microbatches,
                                 "virtual_stages": virtual_stages,
                                 "reshard_after_forward": reshard_after_forward, **r.to_dict(),
                                 "fits": card.check(r.peak_bytes, r.peak_bytes).fits,
                                 "device": device})
    return rows


def stage_plans(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (seq, micro-batch, rank): the fitting strategy with the least recompute (roofline ms)."""
    best: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["seq_len"], r["batch_size"], r["rank"])
        current = best.get(key)
        if not r["fits"]:
            best.setdefault(key, {**r, "strategy": None})
            continue
        if current is None or current["strategy"] is None \
                or (r["recompute_ms"], r["peak_bytes"]) < (current["recompute_ms"],
                                                              current["peak_bytes"]):
            best[key] = r
    return [best[k] for k in sorted(best)]


def print_pp_rows(rows: Sequence[dict[str, Any]], json_out: str | None) -> None:
    """The per-rank table and the plan per stage (unless ``--json -``), and the JSON."""
    from rich.table import Table

    from remat.units import format_bytes

    plans = stage_plans(rows)
    if json_out != "-" and rows:
        first = rows[0]
        sp = " + SP" if first["sequence_parallel"] else ""
        virtual = (f", {first['virtual_stages']} virtual stages"
                   if first["virtual_stages"] > 1 else "")
        # FSDP under a pipeline: NOTE [ FSDP under pipeline parallelism ]
        fsdp = first["dp"] > 1 and first["pp"] > 1
        reshard = (", reshard after forward" if first.get("reshard_after_forward")
                   else ", no reshard after forward") if fsdp else ""
        table = Table(title=f"{first['model']}: PP x{first['pp']} ({first['schedule']}, "
                            f"{first['microbatches']} micro-batches{virtual}), "
                            f"TP x{first['tp']}{sp}, DP x{first['dp']}{reshard} on "
                            f"{first['device']} (simulated, per rank)",
                      title_justify="left")
        headers = ("Seq", "Batch", "Strategy", "Rank", "Blocks", "Held", "Parameters",
                   *(("Gathered",) if fsdp else ()), "Gradients", "Optimizer",
                   "Act / micro-batch", "Peak / rank", "Fits")
        for header in headers:
            table.add_column(header, justify="left" if header == "Strategy" else "right")
        for r in rows:
            blocks = r["blocks"]
            span = f"{blocks[0]}-{blocks[-1]}" if blocks else "-"
            table.add_row(str(r["seq_len"]), str(r["batch_size"]), r["strategy"],
                          str(r["rank"]), span, str(r["held_microbatches"]),
                          format_bytes(r["param_bytes"]),
                          *((format_bytes(r["gathered_param_bytes"]),) if fsdp else ()),
                          format_bytes(r["grad_bytes"]),
                          format_bytes(r["optimizer_bytes"]),
                          format_bytes(r["activation_bytes"]), format_bytes(r["peak_bytes"]),
                          "yes" if r["fits"] else "no")
        console = stdout_console()
        console.print(table)
        plan = Table(title="Plan per stage: the strategy with the least recompute that fits",
                     title_justify="left")
        for header in ("Seq", "Batch", "Rank", "Held", "Strategy", "Peak / rank",
                       "Recompute / micro-batch (roofline)"):
            plan.add_column(header, justify="left" if header == "Strategy" else "right")
        for r in plans:
            fits = r["strategy"] is not None
            plan.add_row(str(r["seq_len"]), str(r["batch_size"]), str(r["rank"]),
                         str(r["held_microbatches"]), r["strategy"] or "nothing fits",
                         format_bytes(r["peak_bytes"]) if fits else "-",
                         f"{r['recompute_ms']:.1f} ms" if fits else "-")
        console.print(plan)
        if fsdp:
            console.print("FSDP under the pipeline: parameter and optimizer shards; "
                          "Gathered: unsharded parameters held at most; gradients unsharded "
                          "(accumulated over micro-batches, reduce-scattered at the step's end).")
        console.print("Fits: the rank's peak with the CUDA context, NCCL buffers and cuBLAS "
                      "workspaces within the card's capacity; point-to-point buffers and the "
                      "caching allocator's segments are not counted: keep a margin.")
    if json_out is not None:
        write_json({"pipeline": list(rows), "stage_plans": plans}, json_out)
