"""``remat simulate --tp T [--sp]``: one tensor-parallel rank's bytes per strategy and size.

Each row is what :func:`remat.simulate.tensor_parallel.tp_rank_bytes` gives: rank 0's step
simulated under a fake process group (NOTE [ One tensor-parallel rank, simulated ] in
simulate/tp_step.py), one parallelized fake copy and one warm-up per sequence length for all
strategies and sizes. Collective backends' buffers are not in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from remat.cli._common import fail, stdout_console, write_json
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


def tp_rows(source: Any, *, name: str, seqs: Sequence[int], batch_sizes: Sequence[int],
            strategies: Sequence[str], tp: int, sequence_parallel: bool, dtype: str,
            optimizer: str, device: str) -> list[dict[str, Any]]:
    """One row per sequence length, strategy and micro-batch size."""
    from remat.card_fit import card_budget
    from remat.device_memory import layout_process_groups
    from remat.simulate.tp_step import simulate_ranks

    # NOTE [ Fits on the card ]: the rank's allocated peak, workspaces and NCCL included
    # (a TP rank's allocations are not replayed through the caching allocator's model)
    card = card_budget(device, process_groups=layout_process_groups(tp=tp))
    rows: list[dict[str, Any]] = []
    for seq_len in seqs:
        points = [(strategy, b) for strategy in strategies for b in batch_sizes]
        ranks = simulate_ranks(source, seq_len=seq_len, points=points, tp=tp,
                               sequence_parallel=sequence_parallel, dtype=dtype,
                               optimizer=optimizer)
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
