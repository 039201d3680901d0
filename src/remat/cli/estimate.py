"""``remat estimate``: closed-form activation formulas next to exact simulated bytes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated

import typer

from remat.cli import app
from remat.cli.common import fail, progress_bar, stdout_console, user_errors, write_json
from remat.cli.options import (
    DtypeOpt,
    HfConfigOpt,
    HfOpt,
    JsonOpt,
    ModuleOpt,
    SetOpt,
    SimModelOpt,
    int_list,
)
from remat.cli.sim_tables import estimate_table
from remat.cli.sources import ModelChoice, given_sources, model_choice
from remat.errors import message

if TYPE_CHECKING:
    from remat.simulate.estimate import EstimateRow


_EPILOG = """\
Examples:

  remat estimate --model llama-7b

  remat estimate --model gpt2-124m --seq 512,1024 --batch 1,8

  remat estimate --hf mistral --seq 2048,4096 --json out/estimate.json

  remat estimate --module examples/my_model.py:build --seq 256,1024 --batch 1,8
"""


API = "remat estimate"


def _check_module(choice: ModelChoice) -> None:
    """Exit 2 unless the formulas can read the ``--module`` model's sizes and the table can
    make batches of every sequence length and batch size."""
    from remat.simulate.estimate import model_dims

    assert choice.user is not None
    simulate = f"run remat simulate --module {choice.name.removeprefix('module:')}"
    try:
        model_dims(choice.user.model)
    except ValueError as exc:
        fail(message(API, f"cannot read the dimensions of {choice.name}'s model",
                     {"needs": "config.hidden_size, num_attention_heads and num_hidden_layers "
                               "(or d_model, n_head, n_layer) for the formulas",
                      "error": str(exc).splitlines()[0]},
                     fix=f"{simulate} for exact bytes without the formulas, or give the "
                         "model a .config with those fields"))
    if choice.fixed_batch is not None and choice.batch_fn is None:
        fail(message(API, f"{choice.name} gives one fixed batch",
                     {"why": "estimate sweeps sequence lengths and batch sizes"},
                     fix="return an object with make_batch(batch_size, seq_len) from the "
                         f"factory, or {simulate} for the fixed batch"))


@app.command("estimate", epilog=_EPILOG)
def estimate_command(
    model: SimModelOpt = None,
    hf: HfOpt = None,
    hf_config: HfConfigOpt = None,
    module: ModuleOpt = None,
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
    layers of presets and Hugging Face models are simulated; per-layer bytes do not
    depend on depth). A --module model needs a config with its hidden size, heads and
    layers (Hugging Face field names, or d_model/n_head/n_layer).
    """
    from remat.simulate.estimate import estimate

    sources = given_sources(model, hf, hf_config, module, overrides)
    seq_lens = int_list(seq, "--seq")
    batch_sizes = int_list(batch, "--batch")
    choice = model_choice(sources, max(seq_lens), api=API, layers=2)
    if choice.user is not None:
        _check_module(choice)
    total = len(seq_lens) * len(batch_sizes) * 2
    done = 0
    with user_errors(), progress_bar(f"estimate {choice.name}", log_when_piped=True) as update:
        def on_row(row: EstimateRow) -> None:
            nonlocal done
            done += 1
            update(f"seq {row.seq_len} batch {row.batch_size}", done, total)

        table = estimate(choice.source, seq_lens=seq_lens, batch_sizes=batch_sizes,
                         dtype=dtype, n_layers=choice.n_layers, batch_fn=choice.batch_fn,
                         loss_fn=choice.loss_fn, on_row=on_row)
    if choice.name != table.model:
        table = dataclasses.replace(table, model=choice.name)
    if json_out != "-":
        stdout_console().print(estimate_table(table))
    if json_out is not None:
        write_json(table.to_dict(), json_out)
