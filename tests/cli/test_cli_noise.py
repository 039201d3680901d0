"""No output the user cannot act on: kineto's USDT lines, transformers'
loss_type line, warnings about transformers' own output-capturing hooks."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch


def test_profile_trace_prints_no_kineto_lines(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    code = ("import sys; from remat.cli import app; sys.argv = ['remat'] + sys.argv[1:]; "
            "app()")
    result = subprocess.run(
        [sys.executable, "-c", code, "profile", "--model", "gpt-tiny", "--batch", "1",
         "--repeats", "1", "--trace", str(trace), "--json", "-"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "USDT" not in result.stderr and "profiler_start" not in result.stderr
    assert trace.stat().st_size > 0


def test_hf_gpt2_built_for_simulation_has_an_explicit_loss_type() -> None:
    transformers = pytest.importorskip("transformers")
    from remat.simulate.hf import hf_model_from_config

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = hf_model_from_config(cfg, device="cpu")
    assert model.loss_type == "ForCausalLM"  # the loss transformers falls back to anyway


def test_transformers_output_capturing_hooks_do_not_warn() -> None:
    transformers = pytest.importorskip("transformers")
    import remat

    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids, output_router_logits=True)  # installs its hooks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.apply(model, "full")
    assert not [w for w in caught if "hook" in str(w.message)]
    hook = next(h for m in model.modules() for h in m._forward_hooks.values())
    assert hook.__module__ == "transformers.utils.output_capturing"
    assert remat.validate(model, {"input_ids": ids, "labels": ids}, "full").passed

    user_hooked = model.model.layers[0].self_attn
    user_hooked.register_forward_hook(lambda module, args, output: None)
    with pytest.warns(remat.RematWarning, match="forward hooks inside a checkpointed region"):
        remat.apply(model, "full")


_NOTICES = """
import warnings
from remat.cli.common import notices
from remat.errors import RematWarning
with warnings.catch_warnings(record=True) as outer:
    warnings.simplefilter("always")
    with notices():
        warnings.warn("foreign", UserWarning)
        warnings.warn("ours", RematWarning)
        warnings.warn("ours", RematWarning)
print([str(w.message) for w in outer])
"""


def test_notices_show_other_warnings_once_and_remat_notes_once() -> None:
    # A foreign warning re-shown inside catch_warnings landed in the list being read: the
    # loop never ended (torch 2.11's profiler warning made `remat profile --trace` eat all
    # memory). In a subprocess so that a regression times out instead of filling memory.
    done = subprocess.run([sys.executable, "-c", _NOTICES], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['foreign']"
    assert done.stderr.count("ours") == 1
