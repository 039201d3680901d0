"""What "fits" means on a card: capacity as PyTorch reports it, memory outside the
allocator, workspaces, and each simulated row's reserved peak against them.

For each named card: its capacity and the default outside terms and workspaces (one rank,
and one rank of an FSDP x 8 group). Then two simulations, each row shown with its
allocated peak, its predicted reserved peak (NOTE [ Reserved per rank ] in
remat/simulate/point.py), the margin left and whether it fits, next to the old reading
(allocated peak against the nominal card size): Llama-7B at seq 2048 on one H100-80GB,
and Llama-3-8B at seq 8192 under FSDP over 8 H100-80GB. Writes the "Fits on the card"
section of RESULTS.md with ``--write``.

    PYTHONPATH=src .venv/bin/python benchmarks/fits.py [--write]
"""

from __future__ import annotations

import argparse
import sys
import time

from _results import RESULTS, replace_section, run_header

from remat.card_fit import card_budget
from remat.devices import DEVICES
from remat.simulate import simulate
from remat.simulate.hf import hf_config_from_name, hf_model_from_config
from remat.units import format_bytes

GIB = 2**30
#: The marketed sizes remat used before capacities were what PyTorch reports.
NOMINAL = {"a100-40gb": 40 * GIB, "a100-80gb": 80 * GIB, "h100-80gb": 80 * GIB,
           "h200": 141 * 10**9, "b200": 180 * 10**9, "l4": 24 * GIB, "rtx-4090": 24 * GIB}

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def _cards() -> str:
    lines = ["| card | nominal | capacity (PyTorch) | outside, 1 rank | outside, FSDP x 8 rank "
             "| workspaces | limit for tensors, 1 rank |", "|---|---|---|---|---|---|---|"]
    for name, spec in DEVICES.items():
        one, fsdp = card_budget(spec, env={}), card_budget(spec, process_groups=(8,), env={})
        lines.append(f"| {name} | {format_bytes(NOMINAL.get(name, spec.capacity_bytes))} | "
                     f"{format_bytes(spec.capacity_bytes)} | {format_bytes(one.outside_bytes)} "
                     f"| {format_bytes(fsdp.outside_bytes)} | {format_bytes(one.workspace_bytes)}"
                     f" | {format_bytes(one.tensor_bytes)} |")
    return "\n".join(lines)


def _rows(result, nominal: int) -> str:  # type: ignore[no-untyped-def]
    lines = ["| strategy | batch | allocated / rank | reserved / rank | left | fits | "
             "old reading (allocated <= nominal) |", "|---|---|---|---|---|---|---|"]
    for row in result.rows:
        fits = "yes" if row.fits else ("expandable" if row.note.startswith("fits with")
                                       else "**no**")
        old = "yes" if row.peak_bytes <= nominal else "no"
        lines.append(f"| {row.strategy} | {row.batch_size} | {format_bytes(row.peak_bytes)} | "
                     f"{format_bytes(row.reserved_bytes)} | {format_bytes(row.margin_bytes)} | "
                     f"{fits} | {old} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite RESULTS.md's section")
    args = parser.parse_args()
    started = time.time()
    seven = simulate("llama-7b", seq_len=2048, batch_sizes=[1, 2, 4, 8],
                     strategies=["none", "full", "ops"], device="h100-80gb", plan=True)
    config = hf_config_from_name("llama", **LLAMA3_8B)
    eight = simulate(lambda: hf_model_from_config(config), seq_len=8192, batch_sizes=[1, 2, 4],
                     strategies=["none", "full"], world_size=8, sharding="fsdp",
                     device="h100-80gb", plan=True)
    body = (run_header("Fits on the card", "fits.py", sys.argv[1:], started)
            + "Cards (NOTE [ Capacity PyTorch reports ] in remat/devices.py; outside terms and "
            "workspaces with their sources in remat/device_memory.py; no environment "
            "variables set):\n\n" + _cards()
            + "\n\nLlama-7B, seq 2048, bf16 + AdamW, one H100-80GB (fast rows; a row within 5% "
            "of the limit is simulated exactly):\n\n" + _rows(seven, NOMINAL["h100-80gb"])
            + "\n\nLlama-3-8B shape, seq 8192, bf16 + AdamW, FSDP over 8 H100-80GB (the "
            "command of the issue that found micro-batches 2 and 4 \"fitting\" at 79.97 and "
            "79.93 GiB):\n\n" + _rows(eight, NOMINAL["h100-80gb"]) + "\n")
    print(body)
    if args.write:
        RESULTS.write_text(replace_section(RESULTS.read_text(), "fits-on-card", body))


if __name__ == "__main__":
    main()
