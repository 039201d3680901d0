"""``remat simulate --tp T [--sp]``: one tensor-parallel rank's bytes per strategy and size.

Each row is what :func:`remat.distributed.tensor_parallel.tp_rank_bytes` gives: rank 0's step
simulated under a fake process group (NOTE [ One tensor-parallel rank, simulated ] in
distributed/tp_step.py), one parallelized fake copy and one warm-up per sequence length for all
strategies and sizes. Collective backends' buffers are not in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat.cli.common import fail, stdout_console, write_json
from remat.errors import message


def check_tp(tp: int, sequence_parallel: bool, world_size: int, api: str) -> None:
    """Exit 2 on a combination the tensor-parallel rows do not model."""
    if sequence_parallel and tp == 1:
        fail(message(api, "--sp needs --tp > 1", {"--tp": tp},
                     fix="pass --tp 2 (or more) with --sp"))
    if tp > 1 and world_size > 1:
        fail(message(api, "--tp with --world-size > 1 is not modelled",
                     {"--tp": tp, "--world-size": world_size,
                      "why": "the tensor-parallel rows simulate one TP rank; "
                             "data parallelism over TP groups is not in them"},
                     fix="pass --dp instead of --world-size (TP groups replicated with FSDP)"))


def load_tp_plan(spec: str, api: str) -> dict[str, Any]:
    """``--tp-plan path/file.py:NAME`` (or ``package.module:NAME``): the dict NAME holds,
    or a function of no arguments returning it (NOTE [ A user's TP plan ] in
    remat/integrations/tp.py). Exits 2 on anything else."""
    from remat.cli.user_model import load_attribute

    plan, _, _ = load_attribute(spec, api, option="--tp-plan")
    name = spec.rpartition(":")[2]
    if callable(plan):
        plan = plan()
    if not isinstance(plan, dict):
        fail(message(api, f"--tp-plan {spec}: {name!r} is not a dict",
                     {"got": type(plan).__name__},
                     fix=f"define {name} = {{'mlp.fc_in': ColwiseParallel(), 'mlp.fc_out': "
                         "RowwiseParallel(), 'lm_head': ColwiseParallel(...)}, or a function "
                         "returning it"))
    return plan


def check_layout(source: Any, seq_len: int, *, tp: int, sequence_parallel: bool,
                 tp_plan: dict[str, Any] | None, api: str) -> None:
    """Exit 2 when remat's layout (or ``tp_plan``) does not fit the model, on a meta copy,
    before any rank is simulated."""
    from torch import nn

    from remat.distributed.tp_layout import check_degree, fused_of, resolve_plan
    from remat.distributed.tp_roles import tp_roles
    from remat.distributed.tp_step import meta_copy
    from remat.errors import RematError
    from remat.simulate.sim_setup import build_model

    model = meta_copy(source) if isinstance(source, nn.Module) else \
        build_model(source, seq_len)[0]
    if tp_plan is not None and sequence_parallel:
        fail(message(api, "--sp with --tp-plan", {"why": "the plan holds its own "
                     "sequence-parallel styles"}, fix="drop --sp (put SequenceParallel() "
                     "entries in the plan)"))
    try:
        if tp_plan is None:  # the fused projections' layouts too (one probe forward)
            roles = tp_roles(model, sequence_parallel=sequence_parallel, api=api)
            fused = fused_of(model, roles, api=api, sequence_parallel=sequence_parallel)
            check_degree(model, roles, fused, tp, api=api)
        else:
            resolve_plan(model, tp_plan, api=api)
    except RematError as error:
        fail(str(error), code=2)


def tp_rows(source: Any, *, name: str, seqs: Sequence[int], batch_sizes: Sequence[int],
            strategies: Sequence[str], tp: int, sequence_parallel: bool, dtype: str,
            optimizer: str, device: str,
            tp_plan: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per sequence length, strategy and micro-batch size."""
    from remat.card_fit import card_budget
    from remat.device_memory import layout_process_groups
    from remat.distributed.tp_step import simulate_ranks

    # NOTE [ Fits on the card ]: the rank's allocated peak, workspaces and NCCL included
    # (a TP rank's allocations are not replayed through the caching allocator's model)
    card = card_budget(device, process_groups=layout_process_groups(tp=tp))
    rows: list[dict[str, Any]] = []
    for seq_len in seqs:
        points = [(strategy, b) for strategy in strategies for b in batch_sizes]
        ranks = simulate_ranks(source, seq_len=seq_len, points=points, tp=tp,
                               sequence_parallel=sequence_parallel, dtype=dtype,
                               optimizer=optimizer, tp_plan=tp_plan)
        for (strategy, b), r in zip(points, ranks, strict=True):
            rows.append({"model": name, "seq_len": seq_len, "strategy": strategy,
                         "batch_size": b, "tp": tp, "sequence_parallel": sequence_parallel,
                         "param_bytes": r.param_bytes, "grad_bytes": r.grad_bytes,
                         "optimizer_bytes": r.optimizer_bytes,
                         "activation_bytes": r.activation_bytes,
                         "peak_bytes": r.peak_bytes,
                         "fits": card.check(r.peak_bytes, r.peak_bytes).fits,
                         "device": device})
    return rows


def print_tp_rows(rows: Sequence[dict[str, Any]], json_out: str | None) -> None:
    """The per-rank table (unless ``--json -``), and the JSON."""
    from rich.table import Table

    from remat.units import format_bytes

    if json_out != "-" and rows:
        first = rows[0]
        sp = " + SP" if first["sequence_parallel"] else ""
        table = Table(title=f"{first['model']}: one rank of TP x{first['tp']}{sp} on "
                            f"{first['device']} (simulated under a fake process group)",
                      title_justify="left")
        for header in ("Seq", "Strategy", "Batch", "Parameters", "Gradients", "Optimizer",
                       "Activations", "Peak / rank", "Fits"):
            table.add_column(header, justify="left" if header == "Strategy" else "right")
        for r in rows:
            table.add_row(str(r["seq_len"]), r["strategy"], str(r["batch_size"]),
                          format_bytes(r["param_bytes"]), format_bytes(r["grad_bytes"]),
                          format_bytes(r["optimizer_bytes"]),
                          format_bytes(r["activation_bytes"]), format_bytes(r["peak_bytes"]),
                          "yes" if r["fits"] else "no")
        console = stdout_console()
        console.print(table)
        console.print("Collective backends' own buffers (NCCL's) are not counted; keep a "
                      "margin.")
    if json_out is not None:
        write_json({"tensor_parallel": list(rows)}, json_out)
