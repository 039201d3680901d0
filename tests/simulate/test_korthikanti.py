"""Korthikanti et al. Table 2: the formula rows, and remat's simulated layer next to them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from remat.measure.outside import cpu_rng_state_bytes
from remat.simulate.formulas import korthikanti_bytes, korthikanti_table2_bytes

S, B, H, A = 32, 2, 64, 4
SBH = S * B * H


def test_table2_rows() -> None:
    shape = {"seq_len": S, "batch_size": B, "hidden_size": H, "n_heads": A}
    assert korthikanti_table2_bytes(**shape) == korthikanti_bytes(**shape)
    assert korthikanti_table2_bytes(**shape, tp=4) == 10 * SBH + (24 * SBH + 5 * A * S * S * B) // 4
    assert korthikanti_table2_bytes(**shape, tp=4, sequence_parallel=True) == (
        34 * SBH + 5 * A * S * S * B) // 4
    assert korthikanti_table2_bytes(**shape, tp=4, recompute="selective") == 16 * SBH
    assert korthikanti_table2_bytes(**shape, tp=4, sequence_parallel=True,
                                    recompute="selective") == 34 * SBH // 4
    assert korthikanti_table2_bytes(**shape, tp=4, recompute="full") == 2 * SBH
    assert korthikanti_table2_bytes(**shape, bytes_per_element=4) == 2 * korthikanti_bytes(
        **shape)
    with pytest.raises(ValueError, match="unknown recompute"):
        korthikanti_table2_bytes(**shape, recompute="some")


def _bench() -> object:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "korthikanti.py"
    spec = importlib.util.spec_from_file_location("korthikanti_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("korthikanti_bench", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore")
def test_simulated_layer_against_the_paper_byte_by_byte() -> None:
    pytest.importorskip("transformers")
    bench = _bench()
    shape = {"seq_len": S, "batch_size": B, "hidden_size": H, "n_heads": A}
    layer = bench.simulated_layer  # type: ignore[attr-defined]
    rng = cpu_rng_state_bytes()
    as2b = A * S * S * B
    # CPU dropout (ATen's unfused path) keeps its mask in the input's dtype (2 B, the paper
    # counts 1 B) and CPU LayerNorm its mean and 1/std in bf16 (2 x s·b x 2 B per norm).
    wide_masks, norm_stats = as2b + SBH + SBH, 2 * (2 * S * B * 2)
    none, none_flops = layer("none", **shape)
    assert none == korthikanti_table2_bytes(**shape) + wide_masks + norm_stats
    assert none_flops == 0
    # The paper's selective row as an op save set on the attention sub-layer: its 5as²b go;
    # remat also recomputes the attention output's dropout mask (sbh, 2 B wide: -2 SBH, of
    # which the paper counts SBH) and keeps the checkpoint's RNG state.
    selective, flops = layer(bench.SELECTIVE, **shape)  # type: ignore[attr-defined]
    assert selective == 34 * SBH + rng + SBH + norm_stats - SBH
    assert selective == korthikanti_table2_bytes(**shape, recompute="selective") + rng + 512
    # recomputed: QKᵀ (2·b·a·s²·d) and the output projection (2·b·s·h²), not ·V
    assert flops == 2 * B * A * S * S * (H // A) + 2 * B * S * H * H, flops
    # Full recompute: the layer input (2sbh, bf16) plus the CPU RNG state checkpoint keeps.
    assert layer("full", **shape)[0] == 2 * SBH + rng
    # remat's "attn" recomputes the whole attention sub-layer: it drops Q, K, V (6sbh) and
    # the output projection's input (2sbh) too.
    assert layer("attn", **shape)[0] == selective - 8 * SBH


@pytest.mark.filterwarnings("ignore")
def test_itemized_layer_names_every_byte() -> None:
    pytest.importorskip("transformers")
    bench = _bench()
    shape = {"seq_len": S, "batch_size": B, "hidden_size": H, "n_heads": A}
    saved = bench.layer_storages(bench.SELECTIVE, **shape)  # type: ignore[attr-defined]
    kept = {(s.unit, s.op): (s.shape, s.dtype, s.nbytes) for s in saved}
    assert kept[("attn.c_attn", "aten.addmm")] == ((B * S, 3 * H), "bfloat16", 6 * SBH)
    assert kept[("attn", "aten.clone")] == ((B, S, A, H // A), "bfloat16", 2 * SBH)
    assert kept[("mlp.dropout", "aten.empty_like")] == ((B, S, H), "bfloat16", 2 * SBH)
    assert not any(s.unit == "attn.resid_dropout" or s.op == "aten._softmax" for s in saved)
    table = bench.itemized_table("none", "none")  # type: ignore[attr-defined]
    assert table.splitlines()[-1] == (
        "| **total** | | | | **197120** | | **180224** | **+16896** |")
    assert "(no term)" not in table and "(not kept)" not in table


@pytest.mark.filterwarnings("ignore")
def test_selective_save_set_keeps_the_gradients() -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from remat.strategies import apply_decisions, remove
    from remat.strategies.builtin.ops import SelectiveOps

    bench = _bench()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        n_embd=H, n_head=A, n_layer=2, n_positions=S, vocab_size=128,
        activation_function="gelu", attn_implementation="eager", use_cache=False)).train()
    ids = torch.randint(0, 128, (B, S))

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks in both runs
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads()
    apply_decisions(model, {f"transformer.h.{i}.attn":
                            SelectiveOps(bench.SELECTIVE_SAVE_OPS)  # type: ignore[attr-defined]
                            for i in range(2)})
    try:
        selective = grads()
    finally:
        remove(model)
    assert len(plain) == len(selective)
    for a, b in zip(plain, selective, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
