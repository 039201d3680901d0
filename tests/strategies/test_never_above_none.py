"""No built-in strategy peaks above ``none``: measured on CPU and simulated.

Checkpointing frees activations at the price of recomputation; a strategy whose step
peaks above the unmodified step's has left something alive it need not (SAC's cached
outputs a recompute never read: NOTE [ Cached outputs no recompute reads ] in
strategies/sac.py; a segment's recorded arguments: ``_close_segment`` in regions.py) or
recomputes more at once than ``none`` keeps (one ``sqrt`` segment over a whole stack:
``sqrt_segments``). The optimizer step is included: what backward leaves alive shows there.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.models import build_model, make_batch
from remat.simulate.run import simulate
from remat.strategies.handler import handler_of
from remat.strategies.registry import BUILTIN as BUILTIN_CLASSES

#: Every built-in strategy, ``every:N`` and ``chunked_head:N`` at N = 2.
BUILTIN = [handler_of(cls).spelling().replace(":N", ":2") for cls in BUILTIN_CLASSES]
SEQ = 32


def _hf_llama(n_layer: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _model_and_batch(name: str, batch_size: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    if name == "hf-llama":
        ids = torch.randint(0, 128, (batch_size, SEQ))
        return _hf_llama(), {"input_ids": ids, "labels": ids.clone()}
    model = build_model(name)
    return model, make_batch(model, batch_size)


def test_the_list_names_every_builtin_strategy() -> None:
    assert len(BUILTIN) == 10 and {"none", "ops", "sqrt", "every:2"} <= set(BUILTIN)


#: The (model, micro-batch size) pairs measured on CPU and the pairs simulated: every pair
#: of the 3 x 2 grid on one of the two paths, and on each path every model and both sizes
#: (each model at one size, the other path taking its other size). A pair left to the
#: other path differs from the pair kept on this one only in the batch dimension.
MEASURED = [("gpt-tiny", 2), ("llama-tiny", 1), ("hf-llama", 1)]
SIMULATED = [("gpt-tiny", 1), ("llama-tiny", 2), ("hf-llama", 2)]


@pytest.mark.parametrize(("name", "batch_size"), MEASURED,
                         ids=[f"{n}-{b}" for n, b in MEASURED])
def test_no_builtin_strategy_peaks_above_none_on_cpu(name: str, batch_size: int) -> None:
    model, batch = _model_and_batch(name, batch_size)
    optimizer = torch.optim.AdamW(model.parameters())
    peaks = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache turned off on the HF model
        for strategy in BUILTIN:
            remat.apply(model, strategy)
            try:
                peaks[strategy] = remat.profile(model, batch, optimizer=optimizer,
                                                timing=False).peak_bytes
            finally:
                remat.remove(model)
    above = {s: p - peaks["none"] for s, p in peaks.items() if p > peaks["none"]}
    assert not above, f"{name} at batch {batch_size}: bytes above none {above}"


@pytest.mark.parametrize(("name", "batch_size"), SIMULATED, ids=[n for n, _ in SIMULATED])
def test_no_builtin_strategy_peaks_above_none_in_simulated_rows(name: str,
                                                                batch_size: int) -> None:
    # Five blocks where the preset allows, so that the fast path (NOTE [ Fast rows ] in
    # simulate/fast_rows.py) gives the rows.
    factory: Any = {"gpt-tiny": lambda: build_model("gpt-tiny"),
                    "llama-tiny": lambda: build_model("llama-tiny", n_layer=5),
                    "hf-llama": lambda: _hf_llama(5)}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = simulate(factory, seq_len=16, batch_sizes=[batch_size], strategies=BUILTIN,
                          device="h100-80gb")
    none = {r.batch_size: r.peak_bytes for r in result.rows if r.strategy == "none"}
    above = [(r.strategy, r.batch_size, r.peak_bytes - none[r.batch_size])
             for r in result.rows if r.peak_bytes > none[r.batch_size]]
    assert len(result.rows) == len(BUILTIN)
    assert not above, f"{name}: (strategy, batch, bytes above none) {above}"


def test_a_segment_keeps_no_recorded_argument_past_its_backward() -> None:
    # A sqrt segment records each member's arguments (rotary tables, masks) for its
    # recompute; the segment's own reference kept them through the optimizer step.
    from remat.core.cost import Category

    torch.manual_seed(0)
    model = build_model("llama-tiny", n_layer=4)  # segments [0, 1], [2, 3]
    batch = make_batch(model, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    left = {}
    for strategy in ("none", "sqrt"):
        remat.apply(model, strategy)
        prof = remat.profile(model, batch, optimizer=optimizer, timing=False)
        remat.remove(model)
        left[strategy] = prof.phase_peaks["optimizer"].breakdown.get(Category.ACTIVATIONS, 0)
    assert left["sqrt"] == left["none"]
