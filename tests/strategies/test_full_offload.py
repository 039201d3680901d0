"""``full_offload`` (NOTE [ Offloaded checkpoints ] in strategies/offload.py).

This PyTorch is CPU-only and cannot make fake CUDA tensors, so the offloading path is
run on the CPU as if it had a separate host: ``_hosted`` lets CPU regions offload, and
for byte counts the host copies go to the meta device (fake runs only), which a CPU
tracker does not count, as a CUDA tracker does not count pinned host copies.
"""

from __future__ import annotations

import pickle
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.devices import get_device
from remat.errors import RematWarning
from remat.measure.profile import profile_simulated
from remat.measure.roofline import op_roofline_ms
from remat.models import build_model, get_config, make_batch, model_from_config
from remat.planning import Plan
from remat.planning.block_run import BlockRun
from remat.planning.candidates import (
    measure_groups,
    measured_candidate,
    offload_exposed_ms,
    on_device_parts,
)
from remat.planning.context import fake_setup
from remat.strategies import BlockContext, Offer, handler_of, offload, regions
from remat.strategies.builtin import Full, FullOffload

H100 = get_device("h100-80gb")


def _hosted(monkeypatch: pytest.MonkeyPatch, host: str = "cpu") -> list[Any]:
    """Let CPU regions offload (host copies on ``host``); return the regions made."""
    monkeypatch.setattr(regions, "offloads_from", lambda device: device.type != "meta")
    monkeypatch.setattr(offload, "HOST", torch.device(host))
    made: list[Any] = []
    real = offload._InputRegion

    def spy(*args: Any, **kwargs: Any) -> Any:
        region = real(*args, **kwargs)
        made.append(region)
        return region

    monkeypatch.setattr(offload, "_InputRegion", spy)
    return made


def _hf_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)).train()
    ids = torch.randint(0, 96, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _builtin(preset: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(preset)  # gpt-tiny: dropout 0.1, so the RNG must be replayed
    return model, make_batch(model, 2)


@pytest.mark.parametrize("make", [lambda: _builtin("gpt-tiny"), lambda: _builtin("llama-tiny"),
                                  _hf_llama], ids=["gpt-tiny", "llama-tiny", "hf-llama"])
def test_gradients_exact_with_each_block_input_on_the_host(
        make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = make()
    made = _hosted(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RematWarning)
        report = remat.validate(model, batch, "full_offload")
    assert report.passed and report.max_rel_error == 0.0 and report.loss_rel_error == 0.0
    # One region per block call; each copied only its hidden state (masks, rotary tables
    # and parameters stay), dropped it at its end, and got it back once in backward.
    assert len(made) == 2
    for region in made:
        (host,) = region.host.values()
        assert host.shape[:2] == (2, batch["input_ids"].shape[1])
        assert region.held == {} and region.back == {} and list(region.uses.values()) == [0]
    assert remat.strategies.applied(model) is None  # validate restored the model


def test_backward_prefetches_the_previous_block_one_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = _builtin("gpt-tiny")
    region_class = offload._InputRegion
    made = _hosted(monkeypatch)
    events: list[tuple[str, int]] = []
    start_back, unpack = region_class._start_back, region_class.unpack

    def spy_start(self: Any) -> Any:
        events.append(("back", made.index(self)))
        return start_back(self)

    def spy_unpack(self: Any, key: int) -> torch.Tensor:
        events.append(("unpack", made.index(self)))
        return unpack(self, key)

    monkeypatch.setattr(region_class, "_start_back", spy_start)
    monkeypatch.setattr(region_class, "unpack", spy_unpack)
    with pytest.warns(RematWarning, match="full_offload is the same as full"):
        remat.apply(model, "full_offload")
    model(**batch).loss.backward()
    # Block 1's backward waits for its own input, then starts block 0's copy back, which
    # block 0's recompute finds already started.
    assert events == [("unpack", 1), ("back", 1), ("back", 0), ("unpack", 0)]


def test_device_bytes_drop_by_the_block_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Many tokens, few parameters: the kept inputs dominate the start of backward.
    config = get_config("gpt-tiny", n_layer=4, vocab_size=32)
    with torch.device("meta"):
        model = model_from_config(config)
    batch = make_batch(config, 64)
    remat.apply(model, "full")
    full = profile_simulated(model, batch)
    made = _hosted(monkeypatch, host="meta")
    with pytest.warns(RematWarning, match="full_offload is the same as full"):
        remat.apply(model, "full_offload")  # the notice reads the device, not the gate
    offloaded = profile_simulated(model, batch)
    hidden_bytes = 64 * 32 * 64 * 4  # (B, T, d_model) fp32, one block's input
    assert full.activation_bytes - offloaded.activation_bytes == 4 * hidden_bytes
    # Block i's input is block i-1's output (attributed to it); block 0's is the
    # embedding's (no block's). The last block's output is not an input.
    full_saved = {b.name: b.saved_bytes for b in full.blocks}
    saved = {b.name: b.saved_bytes for b in offloaded.blocks}
    assert saved == {**{f"blocks.{i}": full_saved[f"blocks.{i}"] - hidden_bytes
                        for i in range(3)}, "blocks.3": full_saved["blocks.3"]}
    # The peak (in backward) drops too, by less: two blocks' inputs are back on the
    # device while the earlier block recomputes, and gradients build up meanwhile.
    assert full.peak_phase == offloaded.peak_phase == "backward"
    assert hidden_bytes < full.peak_bytes - offloaded.peak_bytes < 4 * hidden_bytes
    assert offloaded.recompute_flops == full.recompute_flops
    assert len(made) == 2 * 4  # the warm-up step's regions and the tracked step's
    assert all(h.device.type == "meta" for r in made for h in r.host.values())


def test_on_cpu_it_is_full_and_says_so() -> None:
    model, batch = _builtin("gpt-tiny")
    remat.apply(model, "full")
    full = remat.profile(model, batch, timing=False)
    with pytest.warns(RematWarning, match=r"^remat.apply: full_offload is the same as full "
                                          r"here\n  why: .*CPU"):
        remat.apply(model, "full_offload")
    same = remat.profile(model, batch, timing=False)
    assert (same.peak_bytes, same.activation_bytes, same.recompute_flops) == \
        (full.peak_bytes, full.activation_bytes, full.recompute_flops)


def test_remove_pickle_and_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = _builtin("llama-tiny")
    keys = list(model.state_dict())
    with pytest.warns(RematWarning):
        remat.apply(model, "full_offload")
    info = regions.region_of(model.blocks[0])  # type: ignore[index]
    assert info is not None and info.label == "full_offload"
    assert list(model.state_dict()) == keys
    made = _hosted(monkeypatch)
    loaded = pickle.loads(pickle.dumps(model))
    torch.manual_seed(1)
    loaded(**batch).loss.backward()
    assert len(made) == 2  # the copy's blocks are regions too
    remat.remove(model)
    assert not any(regions.has_region(m) for m in model.modules())
    assert "forward" not in model.blocks[0].__dict__  # type: ignore[index]


def test_plan_json_round_trip_with_the_decision() -> None:
    model, batch = _builtin("gpt-tiny")
    plan = Plan({"blocks.0": FullOffload(), "blocks.1": Full()}, ("blocks.0", "blocks.1"),
                2**30, remat.StepCost(peak_bytes=2**20))
    again = Plan.from_json(plan.to_json())
    assert again == plan and isinstance(again.decisions["blocks.0"], FullOffload)
    assert '"full_offload"' in plan.to_json()
    with pytest.warns(RematWarning, match="full_offload is the same as full"):
        remat.apply(model, again)
    labels = [regions.region_of(b).label for b in model.blocks]  # type: ignore[union-attr]
    assert labels == ["full_offload", "full"]


def _run(saved: int, *ops: Any) -> BlockRun:
    return BlockRun(saved_bytes=saved, forward_peak_bytes=0, backward_peak_bytes=0, ops=ops)


def test_planner_offers_it_on_cuda_and_prices_copies_against_full() -> None:
    def context(runs_on: str) -> BlockContext:
        return BlockContext(forward_ops=(), sublayers={}, cost_device=H100, runs_on=runs_on)

    handler = handler_of(FullOffload)
    assert handler.offers(FullOffload(), context("cpu")) == []
    (offer,) = handler.offers(FullOffload(), context("cuda"))
    assert offer.optional and offer.parts == (("", FullOffload()),)
    assert on_device_parts(offer.parts) == (("", Full()),)

    from remat.core.op_record import OpRecord

    def mm(phase: str, n: int) -> OpRecord:  # a (n x n) @ (n x n) bf16 matmul
        return OpRecord("aten.mm", phase, 2 * n**3, 2 * 2 * n**2, 2 * n**2, dtype_bytes=2)

    hidden = 2**26  # one block's input
    none = _run(10 * hidden, mm("forward", 8192))
    full = _run(hidden)
    ours = _run(0, mm("recompute", 8192), mm("backward", 8192), mm("backward", 8192))
    candidate = measured_candidate(offer.parts, ours, H100, base=none, kept=full)
    transfer_ms = hidden / H100.host_link_bytes_per_s * 1e3
    forward_ms = op_roofline_ms(mm("forward", 8192), H100)
    assert forward_ms < transfer_ms < 3 * forward_ms  # out: partly exposed; back: hidden
    assert candidate.transfer_ms == pytest.approx(transfer_ms - forward_ms, rel=1e-9)
    assert candidate.recompute_ms == pytest.approx(forward_ms + candidate.transfer_ms,
                                                   rel=1e-9)
    assert offload_exposed_ms(hidden, 0.0, H100, backward_ms=0.0) == 2 * transfer_ms
    # Priced like offload without full's run: every byte none keeps, nothing prefetched.
    crude = measured_candidate(offer.parts, ours, H100, base=none)
    assert crude.transfer_ms == pytest.approx(
        max(10 * transfer_ms - forward_ms, 0) + 10 * transfer_ms, rel=1e-9)


def test_planner_measures_it_against_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch = _builtin("gpt-tiny")
    _hosted(monkeypatch, host="meta")
    monkeypatch.setattr(type(handler_of(FullOffload)), "offers",
                        lambda self, config, context: [Offer((("", config),))])
    setup = fake_setup(model, batch, optimizer=None, blocks=None)
    (group,) = measure_groups(setup, H100, prune=False)
    found = {c.label(): c for c in group.candidates}
    ours, full = found["full_offload"], found["full"]
    hidden_bytes = 2 * 32 * 64 * 4
    assert ours.saved_bytes == full.saved_bytes - hidden_bytes
    assert ours.recompute_flops == full.recompute_flops
    assert ours.recompute_ms == pytest.approx(full.recompute_ms + ours.transfer_ms, rel=1e-9)
    # One 16 KiB input each way (0.3 us at the link) hides behind the block's kernels.
    assert ours.transfer_ms == full.transfer_ms == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_copies_hide_behind_compute() -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model("gpt-small", n_layer=8, d_model=1024, n_head=16, max_seq_len=1024,
                            dropout=0.0)
    batch = make_batch(model, 8, device=torch.device("cuda"))

    def step_ms(strategy: str) -> float:
        remat.apply(model, strategy)
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(**batch).loss.backward()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
        return sorted(times[1:])[2]

    full_ms, ours_ms = step_ms("full"), step_ms("full_offload")
    # The copies alone: one hidden state out and back per block, timed with CUDA events.
    x = torch.randn(8, 1024, 1024, device="cuda")
    host = torch.empty(x.shape, pin_memory=True)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(8):
        host.copy_(x, non_blocking=True)
        x.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    copies_ms = begin.elapsed_time(end)
    exposed_ms = max(ours_ms - full_ms, 0.0)
    assert ours_ms <= 1.1 * full_ms, (ours_ms, full_ms)
    assert exposed_ms <= 0.2 * copies_ms, (exposed_ms, copies_ms)
