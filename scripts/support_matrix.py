"""The support matrix: what remat does on each family, checked, and the README's table.

For each model (tiny configs, random weights, CPU, float32, one intra-op thread): speech
(CTC and encoder-decoder), vision (ViT, a CNN, a two-tower model), encoder-decoder,
masked-LM, decoder, mixture-of-experts with data-dependent dispatch, and state-space
families, one row that checks, on the CPU allocator:

* **profile**: :func:`remat.profile`'s peak against the allocator's peak of the same step
  (``allocator_step_peak``): within 0.1%;
* **full**: the allocator's peak of a steady step under ``remat.apply(model, "full")``,
  as a share of the un-checkpointed step's: below 100% (checkpointing frees memory);
* **plan**: :func:`remat.plan` at ``activations:60%`` of the way (else 80%) fits: the
  allocator's peak of the first step after apply, and of a steady step, within the budget
  (``Plan.allocator_peak_bytes``); a refusal must be a remat error in remat's format (the
  call named on the first line, a ``fix:`` line), and is recorded as such;
* **gradients**: :func:`remat.validate` of the plan: loss and every gradient within a
  relative 1e-6 of the un-checkpointed model's.

The full table goes to docs/support.md and the short one into README.md, between the
markers ``<!-- support:start -->`` and ``<!-- support:end -->``; the exit status is 1 when a
check fails. tests/integrations/test_support_matrix.py re-runs rows and compares them with
the README.

Usage::

    PYTHONPATH=src .venv/bin/python scripts/support_matrix.py                # every family
    PYTHONPATH=src .venv/bin/python scripts/support_matrix.py --models vit,bert --no-write
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import remat
from remat.blocks import named_blocks
from remat.errors import BudgetTooSmall, RematError, RematWarning
from remat.measure.profile import allocator_step_peak
from remat.measure.step import Step

ROOT = Path(__file__).resolve().parents[1]
README, DOC = ROOT / "README.md", ROOT / "docs" / "support.md"
START, END = "<!-- support:start -->", "<!-- support:end -->"
BUDGETS = ("activations:60%", "activations:80%")
PROFILE_TOLERANCE = 0.001  # of the allocator's peak
RTOL = 1e-6


# The builders of scripts/compat_matrix.py and benchmarks/families.py, imported by name.
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "benchmarks")]
import compat_matrix as _compat  # noqa: E402
import families as _families  # noqa: E402


@dataclass(frozen=True)
class Family:
    """One row: the model's name, its kind, and how to build it with a batch."""

    name: str
    kind: str
    build: Callable[[], tuple[nn.Module, Any]]


def _arch(key: str) -> Callable[[], tuple[nn.Module, Any]]:
    arch = _compat.ARCHS[key]
    return lambda: (arch.build(), arch.batch())


FAMILIES: dict[str, Family] = {f.name.lower().replace(" ", "-").replace("(", "")
                               .replace(")", ""): f for f in (
    Family("GPT-2", "decoder (Conv1D, tied head)", _arch("gpt2")),
    Family("Llama", "decoder (GQA, rotary)", _arch("llama")),
    Family("Falcon", "decoder (parallel attention + MLP)", _arch("falcon")),
    Family("Mixtral", "mixture of experts (decoder)", _arch("mixtral")),
    Family("JetMoE", "mixture of experts, data-dependent dispatch", _families.MODELS["jetmoe"]),
    Family("litgpt MoE", "mixture of experts, `torch.where` dispatch",
           _families.MODELS["litgpt-moe"]),
    Family("Switch", "mixture of experts, encoder-decoder", _families.MODELS["switch"]),
    Family("Mamba", "state-space LM", _arch("mamba")),
    Family("BERT", "masked LM (encoder)", _arch("bert")),
    Family("RoBERTa", "masked LM (encoder)", _arch("roberta")),
    Family("T5", "encoder-decoder", _arch("t5")),
    Family("BART", "encoder-decoder", _arch("bart")),
    Family("LED", "encoder-decoder, windowed attention", _families.MODELS["led"]),
    Family("Whisper", "speech encoder-decoder", _arch("whisper")),
    Family("wav2vec2", "speech, CTC (conv feature encoder)", _families.MODELS["wav2vec2"]),
    Family("HuBERT", "speech, CTC", _families.MODELS["hubert"]),
    Family("WavLM", "speech, CTC", _families.MODELS["wavlm"]),
    Family("data2vec-audio", "speech, CTC", _families.MODELS["data2vec-audio"]),
    Family("ViT", "vision encoder", _arch("vit")),
    Family("ResNet", "CNN with BatchNorm", _arch("resnet")),
    Family("CLIP", "two towers, contrastive", _arch("clip")),
)}


@dataclass
class Row:
    """The checked figures of one family (``None``: not reached)."""

    family: Family
    blocks: str = ""
    profile_error: float | None = None  # (remat - allocator) / allocator
    full_share: float | None = None  # allocator peak under full / under none
    budget: str = ""
    fits: bool | None = None
    first_step_share: float | None = None  # plan's allocator peak / budget
    refusal: str = ""  # first line of a remat error, where the plan was refused
    grad_error: float | None = None
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _steady_peak(step: Step, start_bytes: int) -> int:
    step.run()  # the first step after a change is warm-up
    return int(allocator_step_peak(step, start_bytes))


def _well_formed(error: BaseException) -> bool:
    """A remat error in remat's format: the call named first, a fix line."""
    lines = str(error).splitlines()
    return bool(lines) and lines[0].startswith("remat.") and any(
        line.strip().startswith("fix:") for line in lines)


def run(key: str) -> Row:
    """Measure and check one family (see the module docstring)."""
    family = FAMILIES[key]
    row = Row(family)
    start = time.perf_counter()
    torch.manual_seed(0)
    model, batch = family.build()
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = remat.profile(model, batch, timing=False)
        step = Step(model, batch)
        static = prof.param_bytes + prof.buffer_bytes + prof.optimizer_bytes + prof.batch_bytes
        none = _steady_peak(step, static)
        row.profile_error = (prof.peak_bytes - none) / none
        remat.apply(model, "full")
        row.full_share = _steady_peak(step, static) / none
        remat.remove(model)
        stacks = sorted({n.rsplit(".", 1)[0] for n, _ in named_blocks(model)})
        share = sum(b.saved_bytes for b in prof.blocks) / max(prof.activation_bytes, 1)
        row.blocks = f"{len(prof.blocks)} in {', '.join(stacks)} ({share:.0%})"
        plan = None
        for budget in BUDGETS:
            row.budget = budget
            try:
                plan = remat.plan(model, batch, budget=budget)
                break
            except BudgetTooSmall as error:
                if budget == BUDGETS[-1]:
                    row.refusal = str(error).splitlines()[0]
                    if not _well_formed(error):
                        row.failures.append(f"refusal not in remat's format: {error}")
            except RematError as error:
                row.refusal = str(error).splitlines()[0]
                if not _well_formed(error):
                    row.failures.append(f"refusal not in remat's format: {error}")
                break
        if plan is not None:
            allocated = plan.allocator_peak_bytes
            row.fits = allocated is not None and allocated <= plan.budget_bytes
            row.first_step_share = None if allocated is None else allocated / plan.budget_bytes
            row.grad_error = remat.validate(model, batch, plan).max_rel_error
    row.notes = sorted({str(w.message).splitlines()[0].split(": ", 1)[-1] for w in caught
                        if issubclass(w.category, RematWarning)})
    if abs(row.profile_error) > PROFILE_TOLERANCE:
        row.failures.append(f"profile {row.profile_error:+.3%} of the allocator")
    if row.full_share >= 1.0:
        row.failures.append(f"full leaves the peak at {row.full_share:.1%} of none")
    if row.fits is False:
        row.failures.append(f"plan over its budget ({row.first_step_share:.2%})")
    if row.grad_error is not None and row.grad_error > RTOL:
        row.failures.append(f"gradients differ (relative {row.grad_error:.1e})")
    row.seconds = time.perf_counter() - start
    return row


def _plan_cell(row: Row) -> str:
    if row.refusal:
        return f"refused, with a fix: `{row.refusal[:70]}`"
    if row.fits is None:
        return "-"
    budget = row.budget.replace("activations:", "act ")
    verdict = "fits" if row.fits else "**over**"
    return f"{verdict} at {budget} (first step {row.first_step_share:.1%} of it)"


def _grad_cell(row: Row) -> str:
    if row.grad_error is None:
        return "-"
    return "exact" if row.grad_error <= RTOL else f"**{row.grad_error:.1e}**"


def readme_line(row: Row) -> str:
    """The README's row of ``row`` (a check that failed is in bold)."""
    profile = f"{row.profile_error:+.2%}" if row.profile_error is not None else "-"
    full = f"{row.full_share:.1%}" if row.full_share is not None else "-"
    return (f"| {row.family.name} | {row.family.kind} | {profile} | {full} | "
            f"{_plan_cell(row)} | {_grad_cell(row)} |")


README_HEAD = ("| model | kind | profile vs allocator | `full` peak (of `none`) | "
               "`remat.plan`, checked on the allocator | gradients |\n"
               "|---|---|--:|--:|---|---|")


def doc_line(row: Row) -> str:
    notes = "; ".join(n[:90] for n in row.notes) or ""
    return readme_line(row) + f" {row.blocks} | {notes} |"


def _versions() -> str:
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{platform.machine()}, {time.strftime('%Y-%m-%d')}")


def write(rows: list[Row]) -> None:
    """docs/support.md (every column) and the README's block between the markers."""
    doc = [
        "# Support matrix",
        "",
        "Produced by `PYTHONPATH=src .venv/bin/python scripts/support_matrix.py` "
        f"({_versions()}); what each column checks is in the script's docstring. Tiny "
        "configs, random weights, CPU, float32.",
        "",
        README_HEAD.splitlines()[0] + " blocks found (share of activation bytes) | "
        "warnings |",
        README_HEAD.splitlines()[1] + "---|---|",
        *(doc_line(r) for r in rows),
        "",
    ]
    DOC.write_text("\n".join(doc))
    text = README.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    block = "\n".join([START, README_HEAD, *(readme_line(r) for r in rows), END])
    README.write_text(head + block + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(FAMILIES),
                        help=f"comma-separated, of: {', '.join(FAMILIES)}")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keys = args.models.split(",")
    unknown = [k for k in keys if k not in FAMILIES]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(FAMILIES)}")
    rows = []
    for key in keys:
        row = run(key)
        rows.append(row)
        print(readme_line(row), f"{row.seconds:.0f} s", *row.failures, flush=True)
    if not args.no_write:
        write(rows)
    sys.exit(1 if any(r.failures for r in rows) else 0)


if __name__ == "__main__":
    main()
