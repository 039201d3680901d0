"""Korthikanti et al. Table 2 per tensor-parallel rank: OPT's layout, and one simulated OPT
layer's bytes on a rank against the shapes (benchmarks/_korthikanti_tp.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from remat.measure.outside import cpu_rng_state_bytes

S, B, H, A = 32, 2, 64, 16
SHAPE = {"seq_len": S, "batch_size": B, "hidden_size": H, "n_heads": A}


def _bench() -> Any:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "_korthikanti_tp.py"
    spec = importlib.util.spec_from_file_location("korthikanti_tp_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("korthikanti_tp_bench", module)
    spec.loader.exec_module(module)
    return module


def test_opt_layout_splits_like_megatron() -> None:
    pytest.importorskip("transformers")
    from remat.integrations.tp import tp_plan

    model = _bench().opt_model(2, **{k: v for k, v in SHAPE.items() if k != "batch_size"})
    plan = {n: type(p).__name__ for n, p in tp_plan(model, sequence_parallel=True).items()}
    layer = "model.decoder.layers.1"
    assert {plan[f"{layer}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {
        "ColwiseParallel"}
    assert plan[f"{layer}.self_attn.out_proj"] == plan[f"{layer}.fc2"] == "RowwiseParallel"
    assert plan[f"{layer}.fc1"] == "ColwiseParallel"  # on the block: gathers its own input
    fc1 = tp_plan(model, sequence_parallel=True)[f"{layer}.fc1"]
    assert fc1.input_layouts[0].is_shard(-2)
    assert plan[f"{layer}.final_layer_norm"] == plan["model.decoder.final_layer_norm"] == \
        "SequenceParallel"
    # learned positions are added after the token embedding: it stays whole, and the
    # first layer's input is sharded on the sequence (Megatron's scatter)
    assert plan["model.decoder.layers.0"] == "PrepareModuleInput"
    assert "model.decoder.layers.0" not in tp_plan(model)


@pytest.mark.filterwarnings("ignore")
def test_one_opt_layer_per_rank_from_the_shapes() -> None:
    pytest.importorskip("transformers")
    bench = _bench()
    sbh, as2b = S * B * H, A * S * S * B  # elements
    stats = 2 * (2 * S * B * 2)  # two LayerNorms' mean and 1/std, bf16 on CPU
    # Kept whole on a TP rank: layer input, LN 1 output, attention dropout mask, LN 2
    # input, LN 2 output, MLP dropout mask (bf16: 2 B each; CPU masks are bf16), the
    # norms' statistics. Divided by t: Q, Kᵀ, V, the output projection's input (2 B x
    # sbh each), GELU input and output (2 B x 4sbh each); the softmax output (fp32),
    # its dropout mask and output (bf16), each a·s·s·b.
    whole, split = 6 * 2 * sbh + stats, 4 * 2 * sbh + 2 * 2 * 4 * sbh + (4 + 2 + 2) * as2b
    assert bench.rank_layer_bytes("none", tp=2, sequence_parallel=False, **SHAPE) == \
        whole + split // 2 == 229888
    # SP divides the residual stream, the masks and the statistics too; the norms' outputs
    # stay whole (the colwise linears save them all-gathered).
    assert bench.rank_layer_bytes("none", tp=4, sequence_parallel=True, **SHAPE) == \
        2 * 2 * sbh + (whole - 2 * 2 * sbh + split) // 4
    # Selective: the three a·s·s·b tensors are recomputed; the attention sub-layer's
    # checkpoint keeps the CPU RNG state (whole).
    assert bench.rank_layer_bytes(bench.AttentionOps(), tp=2, sequence_parallel=True,
                                  **SHAPE) == \
        2 * 2 * sbh + cpu_rng_state_bytes() + (whole - 2 * 2 * sbh + split - 8 * as2b) // 2
