"""A Hugging Face decoder with rotary embeddings and grouped-query attention compiled whole
(``torch.compile(model)``, activation memory budget 1.0, the default): the real and the
simulated compiled profiles against the CPU allocator's own step, to the byte.

One case, one layer: compiling is slow on CPU, and the rotary embedding and grouped-query
attention are the same in every layer (a second layer doubled the graph inductor compiles
and the simulation generates code for, and checked nothing more). The profiles must leave
the user's compiled model as it was (no new dynamo graph afterwards: NOTE [ Measuring
compiled code ]).
"""

from __future__ import annotations

import pytest
import torch

import remat
from loading import load_measure_helper
from remat.compiled.measure import dynamo_graph_count


def test_a_compiled_gqa_rotary_decoder_reads_the_allocators_peak() -> None:
    transformers = pytest.importorskip("transformers")
    allocator_util = load_measure_helper("allocator_util")
    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 128, (2, 64))
    batch = {"input_ids": ids, "labels": ids.clone()}
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model)
    simulated = remat.profile(compiled, batch, optimizer=optimizer, simulate=True,
                              timing=False)
    real = remat.profile(compiled, batch, optimizer=optimizer, timing=False)
    graphs = dynamo_graph_count()
    static = real.param_bytes + real.buffer_bytes + real.batch_bytes + real.optimizer_bytes
    truth = allocator_util.allocator_step_peak(compiled, batch, baseline_bytes=static,
                                               optimizer=optimizer).absolute_peak_bytes
    assert dynamo_graph_count() == graphs  # the profiles left nothing dynamo recompiles
    assert real.peak_bytes == truth, f"real {real.peak_bytes} B, allocator {truth} B"
    assert simulated.peak_bytes == truth, f"simulated {simulated.peak_bytes} B, allocator {truth} B"
    assert simulated.activation_bytes == real.activation_bytes
