"""Fused-QKV tensor parallelism on 2 gloo ranks against one process: gradients per model.

For tiny Hugging Face decoders whose attention has one fused projection (GPT-2's Conv1D
``c_attn``, GPT-NeoX's and Falcon's ``query_key_value``, Phi-3's ``qkv_proj``), litgpt's
``attn.qkv`` and remat's own GPT, each rank builds the same model, applies remat's built-in
layout (:func:`remat.integrations.tp.apply_tp`) and ``full`` checkpointing, and runs one
step; the gradients, gathered and put back in natural order
(:func:`remat.distributed.tp_fused.natural_order`), are compared with one process's on the
un-parallelized model. Prints the loss of each and the worst relative gradient error
(``max |g_tp - g| / max |g|`` per parameter).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/tp_fused_gloo.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn

VOCAB, WIDTH, HEADS = 128, 64, 4


class _Lit(nn.Module):
    """litgpt's GPT (fused ``attn.qkv``, grouped queries) with a Hugging Face-style loss."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt import GPT, Config

        self.gpt = GPT(Config(block_size=32, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                              n_layer=2, n_head=HEADS, n_query_groups=2, n_embd=WIDTH,
                              intermediate_size=2 * WIDTH, mlp_class_name="LLaMAMLP",
                              norm_class_name="RMSNorm", bias=False, rotary_percentage=1.0,
                              parallel_residual=False))
        self.config = types.SimpleNamespace(vocab_size=VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.gpt(input_ids)
        return types.SimpleNamespace(
            loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def models() -> dict[str, Callable[[], nn.Module]]:
    import transformers as hf

    import remat.models

    sizes = {"vocab_size": VOCAB, "tie_word_embeddings": False}
    return {
        "GPT-2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
            n_embd=WIDTH, n_layer=2, n_head=HEADS, n_positions=32, resid_pdrop=0,
            embd_pdrop=0, attn_pdrop=0, **sizes)),
        "GPT-NeoX": lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
            intermediate_size=2 * WIDTH, max_position_embeddings=32, **sizes)),
        "Falcon (parallel block)": lambda: hf.FalconForCausalLM(hf.FalconConfig(
            hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
            multi_query=False, **sizes)),
        "Falcon (grouped KV)": lambda: hf.FalconForCausalLM(hf.FalconConfig(
            hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
            new_decoder_architecture=True, num_kv_heads=2, **sizes)),
        "Phi-3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=0, **sizes)),
        "litgpt (GQA)": _Lit,
        "remat GPT": lambda: remat.models.build_model("gpt-tiny", n_layer=2, tie_weights=False,
                                                      dropout=0.0),
    }


def _worker(rank: int, store: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    import remat
    from remat.distributed.tp_fused import natural_order
    from remat.distributed.tp_layout import fused_of
    from remat.distributed.tp_roles import tp_roles
    from remat.integrations.tp import apply_tp

    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, build in models().items():
        torch.manual_seed(0)
        ref = build()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.manual_seed(0)
        model = build()
        fused = fused_of(model, tp_roles(model), api="tp_fused_gloo")
        apply_tp(model, mesh)
        remat.apply(model, "full")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        reference = dict(ref.named_parameters())
        worst = 0.0
        for param_name, param in model.named_parameters():
            assert param.grad is not None
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") \
                else param.grad
            module = param_name.rpartition(".")[0]
            dim = 0 if grad.dim() == 1 else (1 if "c_attn" in param_name else 0)  # Conv1D
            if module in fused and fused[module][0] != (grad.shape[dim],):
                grad = natural_order(grad, dim, fused[module][0], 2)
            want = reference[param_name].grad
            assert want is not None
            worst = max(worst, float((grad - want).abs().max() / max(want.abs().max(), 1e-5)))
        if rank == 0:
            print(f"| {name} | {float(ref_loss):.6f} | {float(loss):.6f} | {worst:.1e} |",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    print(f"torch {torch.__version__}; 2 gloo ranks, t = 2, `full` on top\n")
    print("| model | loss, one process | loss, 2 ranks | worst relative gradient error |")
    print("|---|--:|--:|--:|", flush=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    spawn(_worker, args=(store,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
