"""``remat estimate``: closed-form activation formulas next to exact simulated bytes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated

import typer

from remat.cli import app
from remat.cli._common import progress_bar, stdout_console, user_errors, write_json
from remat.cli._sim_tables import estimate_table
from remat.cli._sources import int_list, model_choice
from remat.cli._sources import overrides as parse_overrides
from remat.cli.options import DtypeOpt, HfConfigOpt, HfOpt, JsonOpt, SetOpt, SimModelOpt

if TYPE_CHECKING:
    from remat.simulate.estimate import EstimateRow


_EPILOG = """\
Examples:

  remat estimate --model llama-7b

  remat estimate --model gpt2-124m --seq 512,1024 --batch 1,8

  remat estimate --hf mistral --seq 2048,4096 --json out/estimate.json
"""


@app.command("estimate", epilog=_EPILOG)
def estimate_command(
    model: SimModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    overrides: SetOpt = None,
    seq: Annotated[str, typer.Option(
        "--seq", "-s", metavar="S1,S2,...", help="Sequence lengths.",
    )] = "512,1024,2048,4096,8192",
    batch: Annotated[str, typer.Option(
        "--batch", "-b", metavar="B1,B2,...", help="Micro-batch sizes.",
    )] = "1,4,8",
    dtype: DtypeOpt = "bf16",
    json_out: JsonOpt = None,
) -> None:
    """Closed-form activation estimates next to the exact simulated bytes, per layer.

    Formulas: the 12·s·b·h rule of thumb; Korthikanti et al. 2022 Eq. 1,
    s·b·h·(34 + 5·a·s/h) bytes; its fused-attention variant 34·s·b·h; and 2·s·b·h
    with full checkpointing. The simulated figure is exact for this model (two
    layers are simulated; per-layer bytes do not depend on depth).
    """
    from remat.simulate.estimate import estimate

    seq_lens = int_list(seq, "--seq")
    batch_sizes = int_list(batch, "--batch")
    choice = model_choice(model, hf, hf_config, parse_overrides(overrides), max(seq_lens),
                          layers=2)
    total = len(seq_lens) * len(batch_sizes) * 2
    done = 0
    with user_errors(), progress_bar(f"estimate {choice.name}", log_when_piped=True) as update:
        def on_row(row: EstimateRow) -> None:
            nonlocal done
            done += 1
            update(f"seq {row.seq_len} batch {row.batch_size}", done, total)

        table = estimate(choice.source, seq_lens=seq_lens, batch_sizes=batch_sizes,
                         dtype=dtype, n_layers=choice.n_layers, on_row=on_row)
    if choice.name != table.model:
        table = dataclasses.replace(table, model=choice.name)
    if json_out != "-":
        stdout_console().print(estimate_table(table))
    if json_out is not None:
        write_json(table.to_dict(), json_out)
