"""The longest sequence a Llama-3-8B-class model trains at, per strategy, simulated.

Llama-3-8B's shape (32 layers, d 4096, 32 heads with 8 key/value heads, MLP 14336,
vocabulary 128256), bf16 weights with AdamW, one H100-80GB per rank with FSDP over 8 ranks,
micro-batch 1: ``remat simulate`` (fake tensors, nothing allocated) at each sequence length
of ``--seq``, for ``none``, ``full``, ``full_offload`` (the checkpoint's inputs in host
memory), ``full`` and ``full_offload`` each with the chunked head and loss, and the plan.
It writes the ``long_context`` section of ``benchmarks/RESULTS.md``: per strategy the
longest of those lengths that fits the card (reserved peak with workspaces within the
capacity PyTorch reports less the memory outside the allocator), its allocated and reserved
peaks, the margin left, and the ratio to ``full``.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/long_context.py
    PYTHONPATH=src .venv/bin/python benchmarks/long_context.py --seq 8192,16384 --no-write
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, replace_section, run_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "long_context"
SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 262144}
STRATEGIES = ("none", "full", "full_offload", "full+chunked_head:16",
              "full_offload+chunked_head:16")


def simulate_command(seqs: str, out: Path) -> list[str]:
    """The ``remat simulate`` command line this benchmark runs."""
    sets = [arg for key, value in SHAPE.items() for arg in ("--set", f"{key}={value}")]
    return [str(Path(sys.executable).parent / "remat"), "simulate", "--hf", "llama", *sets,
            "--seq", seqs, "--batch", "1", "--dtype", "bf16", "--device", "h100-80gb",
            "--world-size", "8", "--sharding", "fsdp", "--strategies", ",".join(STRATEGIES),
            "--json", str(out)]


def table(longest: dict[str, dict[str, int] | None]) -> str:
    """Markdown: the longest fitting sequence per strategy, and against ``full``."""
    full = longest.get("full")
    lines = ["| strategy | longest sequence that fits | allocated per rank | reserved per rank "
             "| left on the card | vs `full` |", "|---|---:|---:|---:|---:|---:|"]
    for name, row in longest.items():
        if row is None:
            lines.append(f"| `{name}` | none of them | - | - | - | - |")
            continue
        ratio = f"{row['seq_len'] / full['seq_len']:.0f}x" if full else "-"
        lines.append(f"| `{name}` | {row['seq_len']:,} | {row['peak_bytes'] / 2**30:.2f} GiB "
                     f"| {row.get('reserved_bytes', 0) / 2**30:.2f} GiB "
                     f"| {row.get('margin_bytes', 0) / 2**30:.2f} GiB | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="16384,32768,65536,131072",
                        help="comma-separated sequence lengths (default: %(default)s)")
    parser.add_argument("--no-write", action="store_true", help="print, don't edit RESULTS.md")
    args = parser.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "simulate.json"
        subprocess.run(simulate_command(args.seq, out), check=True, cwd=ROOT)
        data = json.loads(out.read_text())
    longest = data["longest_seq"]
    body = (run_header("Long context: the longest sequence per strategy (simulated)",
                       "long_context.py", argv if argv is not None else sys.argv[1:], started)
            + "Llama-3-8B shape, bf16 + AdamW, H100-80GB per rank, FSDP over 8 ranks, "
              f"micro-batch 1, sequence lengths {args.seq}.\n\n" + table(longest) + "\n")
    print(body)
    if not args.no_write:
        text = RESULTS.read_text() if RESULTS.exists() else ""
        RESULTS.write_text(replace_section(text, SECTION, body))
        print(f"Wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
