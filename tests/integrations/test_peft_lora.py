"""PEFT LoRA: a tiny Llama wrapped by ``peft.get_peft_model`` (LoRA on q/v), no downloads.

Runs examples/lora_peft.py once (module scope) and checks its numbers: the profile
against the CPU allocator, every strategy's gradients on the LoRA parameters, a plan
between ``full`` and ``none``, and the activation bytes frozen weights do not save.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from loading import load_example, load_measure_helper

# Checked without importing: the packages load only in the worker that runs these tests.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("peft", "transformers")),
    reason="needs peft and transformers")

BATCH, SEQ, HIDDEN, MLP, RANK = 2, 32, 64, 128, 4



@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("lora_peft.py")


@pytest.fixture(scope="module")
def run(example: ModuleType) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("ignore", FutureWarning)
            result: dict[str, Any] = example.main(["--batch", str(BATCH), "--seq", str(SEQ),
                                                   "--rank", str(RANK)])
        return {**result, "stdout": out.getvalue()}
    finally:
        torch.set_num_threads(threads)


def test_blocks_are_found_through_the_peft_wrapper(run: dict[str, Any]) -> None:
    assert [b.name for b in run["none"].blocks] == [
        "base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    assert len(run["lora_params"]) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    assert all(".lora_" in name for name in run["lora_params"])


def test_every_strategy_is_gradient_exact_on_the_lora_params(run: dict[str, Any]) -> None:
    assert run["errors"] == dict.fromkeys(
        ("full", "every:2", "sqrt", "attn", "mlp", "ops", "offload"), 0.0)


def test_frozen_weights_save_no_inputs_for_their_gradients(run: dict[str, Any]) -> None:
    # Layer 1 of the trainable model saves, only for weight gradients: the normalized
    # hidden state each RMSNorm multiplies by its weight (2 x h), the gate/up input (h)
    # and the down_proj input (i). LoRA adds its A outputs for q and v (2 x r).
    tokens = BATCH * SEQ
    frozen_saving = tokens * (3 * HIDDEN + MLP) * 4 - 2 * tokens * RANK * 4
    base, lora = run["base"].blocks[1].saved_bytes, run["none"].blocks[1].saved_bytes
    assert base - lora == frozen_saving == 79_872, (base, lora)
    assert run["none"].activation_bytes < run["base"].activation_bytes
    # The plan is measured, so its un-checkpointed peak is the LoRA model's own.
    assert run["plan"].no_checkpoint_peak_bytes == run["none"].peak_bytes


def test_plan_between_full_and_none_fits_and_is_exact(run: dict[str, Any]) -> None:
    plan, none, full = run["plan"], run["none"].peak_bytes, run["full"].peak_bytes
    assert full < plan.budget_bytes < none
    assert plan.budget_bytes == (none + full) // 2
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes, (plan.measured_peak_bytes,
                                                           plan.budget_bytes)
    assert not plan.is_empty
    assert all(name.startswith("base_model.model.model.layers.") for name in plan.decisions)
    assert run["plan_parity"].max_rel_error == 0.0


@pytest.mark.parametrize("strategy", ["none", "full"])
def test_profile_is_exact_against_the_allocator(example: ModuleType, strategy: str) -> None:
    import remat

    allocator_util = load_measure_helper("allocator_util")
    model = example.with_lora(example.tiny_llama(), rank=RANK)
    batch = example.make_batch(BATCH, SEQ)
    remat.apply(model, strategy)
    prof = remat.profile(model, batch, timing=False)
    static = prof.param_bytes + prof.buffer_bytes + prof.batch_bytes
    alloc = allocator_util.allocator_step_peak(model, batch, baseline_bytes=static)
    gap = alloc.absolute_peak_bytes - prof.peak_bytes
    # At most the attention kernel's scratch, as tests/measure/test_measure_allocator.py allows.
    assert 0 <= gap <= 1024, (strategy, prof.peak_bytes, alloc.absolute_peak_bytes)


def test_input_require_grads_hook_changes_nothing(example: ModuleType) -> None:
    """PEFT's ``enable_input_require_grads`` (what Trainer calls for reentrant
    checkpointing) makes the embedding output require grad; remat's non-reentrant
    regions do not need it, and stay exact with it."""
    import remat

    model = example.with_lora(example.tiny_llama(), rank=RANK)
    model.enable_input_require_grads()
    report = remat.validate(model, example.make_batch(BATCH, SEQ), "full")
    assert report.max_rel_error == 0.0 and len(report.per_param_rel_error) == 8


def test_example_prints_what_it_did(run: dict[str, Any]) -> None:
    out, plan = run["stdout"], run["plan"]
    assert f"saved activations, LoRA:          {run['none'].activation_bytes:,} B" in out
    assert f"plan for {plan.budget_bytes:,} B: measured peak {plan.measured_peak_bytes:,} B" \
        in out
    assert out.count("PASS max rel error 0.0e+00 over 8 gradients") == 7
