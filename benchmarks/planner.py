"""Benchmark the planner against every manual strategy; write RESULTS.md and a frontier plot.

For gpt-small and llama-small (batch 8, full sequence length, CPU, float32):

1. measure every manual strategy (none, full, every:N for all N, sqrt, attn, mlp, ops)
   with :func:`remat.compare.frontier.frontier`: peak bytes, and recompute cost as the
   roofline time of the recomputed ops with H100 figures;
2. for budgets 25%, 50% and 75% of the way from the full-checkpoint peak to the
   no-checkpoint peak, run :func:`remat.plan` (closed loop measured for real) and
   compare its recompute cost with the cheapest manual strategy whose peak fits;
3. check the gradients of every plan against the un-checkpointed model;
4. time planning a 12-layer model end to end;
5. compute a lower bound on the recompute any plan needs, an LP relaxation over the
   forward's graph of storages (NOTE [ Lower bound ]), and print plan / best manual and
   plan / lower bound per case.

Besides the built-in presets it plans held-out Hugging Face decoders built in-process
from tiny configs (Llama, Qwen2, GPT-NeoX, Phi; 6 layers). ``--models held-out`` plans
families no test under tests/planning/ uses (two mixture-of-experts decoders, one with
dropout, parallel attention + MLP blocks, sandwich norms; ``HELD_OUT_RUNS``), kept out of
tuning by tests/benchmarks/test_planner_held_out.py, and writes them to their own section
(``planner-held-out``), with the bound ratio per case. ``--models families`` plans issue
#31's five decoders and six more no test uses (``FAMILY_RUNS``, section
``planner-families``); ``--models generated``
plans seeded random decoders from tests/generated_models.py (``GENERATED_SEEDS``, section
``planner-generated``): no fixed set to tune on.

NOTE [ Lower bound ]
    Premise: to fit budget B a plan frees ``need = none_peak - B`` bytes, i.e. the bytes
    it keeps for backward (saved storages it does not drop, plus any other storage it
    keeps) are at most ``saved - need``, where ``saved`` is what ``none`` keeps. The
    forward is recorded as a graph over storages (NOTE [ Forward graph over storages ] in
    benchmarks/_bound.py): groups of ops with roofline cost ``c_g``, the storages each
    writes and reads. The LP has ``s_t`` in [0, 1] per storage (kept for backward) and
    ``y_g`` in [0, 1] per group (re-run), and minimises ``sum c_g y_g`` subject to

    - ``s_t + y_g(t) >= 1`` for every saved storage t (backward finds it kept or re-made);
    - ``y_g <= s_u + y_g(u)`` for every input u of every group g (a re-run reads its
      inputs, so each is kept or re-made itself: chains);
    - ``sum_t b_t s_t <= saved - need`` (the premise).

    A plan that fits is an integer point: ``s_t = 1`` for what it keeps, ``y_g = 1`` for
    what it re-runs, and its recompute is at least ``sum c_g y_g``, since it runs every op
    of every re-run group (a storage's content needs all its writes) and more besides
    (transient bytes of a recompute only add to its peak). So the LP optimum is at most
    every fitting plan's recompute. Anything the graph cannot see is dropped, never
    guessed: storages made outside the recording are free, shape-only reads are not
    inputs, and each group is charged once however many of its outputs are freed.
    Relaxing ``y_g`` further to "re-run a group frees all its saved outputs", with no
    inputs, gives the fractional knapsack (cheapest cost per byte first): the greedy
    bound. Any LP point gives a knapsack point of the same cost, so greedy <= LP; both
    are valid and the reported bound is their maximum. ``plan / lower bound >= 1``, and
    the gap bounds how much better any plan could be. It bounds plans that free bytes
    by recomputing (offloading frees them without, and is not planned on CPU); a chunked
    head frees bytes besides saved storages, which NOTE [ A chunked head in the bound ] in
    benchmarks/_bound.py takes into account, and every moment of backward binds a plan
    besides the peak (NOTE [ Moments of backward in the bound ] there). The same
    program in integers is a bound too, by the same argument (benchmarks/bound_gap.py
    uses it to tell the LP's integrality gap from the planner's).

Then it replaces the section between ``<!-- planner:start -->`` and
``<!-- planner:end -->`` in ``benchmarks/RESULTS.md`` (created when missing) and draws
``benchmarks/planner.png`` (the frontier at the 50% budget, one panel per model).

Usage::

    .venv/bin/python benchmarks/planner.py               # real measurements
    .venv/bin/python benchmarks/planner.py --simulate    # FakeTensorMode (same bytes on CPU)
    .venv/bin/python benchmarks/planner.py --models hf --results benchmarks/RESULTS_planner_new.md
    .venv/bin/python benchmarks/planner.py --models held-out --timings '' --no-throughput
    .venv/bin/python benchmarks/planner.py --models families --timings '' --no-throughput
    .venv/bin/python benchmarks/planner.py --models generated --timings '' --no-throughput
    .venv/bin/python benchmarks/planner.py --models architectures --timings '' --no-throughput
    .venv/bin/python benchmarks/planner.py --models generated --seeds 100,110 --timings '' \
        --no-throughput --results /tmp/gen.md   # a few seeds, written elsewhere
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from remat.compare.frontier import Frontier, FrontierPoint, frontier
from remat.measure.profile import profile
from remat.measure.step import call_model, default_loss
from remat.models import build_model, make_batch
from remat.planning import Plan, plan, plan_throughput, prepare
from remat.report.plots import plot_frontier
from remat.report.tables import frontier_markdown, markdown_table
from remat.strategies.head import output_head
from remat.units import format_bytes
from remat.validation import validate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bound import ForwardGraph, forward_graph, knapsack_bound_ms, lp_bound_ms  # noqa: E402
from _results import cpu_name as _cpu_name  # noqa: E402
from _results import replace_section  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PLOT = HERE / "planner.png"
SECTION = "planner"
HELD_OUT_SECTION = "planner-held-out"
RUNS: tuple[tuple[str, int], ...] = (("gpt-small", 8), ("llama-small", 8))
HF_RUNS: tuple[tuple[str, int], ...] = (("hf-llama", 4), ("hf-qwen2", 4), ("hf-gpt-neox", 4),
                                        ("hf-phi", 4))
#: More held-out decoders (``--models hf-more``): dropout on (GPT-2, OPT), no bias (Mistral),
#: GeGLU and a scaled embedding (Gemma), q/k norms (Qwen3), partial rotary (StableLM).
HF_MORE_RUNS: tuple[tuple[str, int], ...] = tuple(
    (name, 4) for name in ("hf-gpt2", "hf-mistral", "hf-gemma", "hf-opt", "hf-qwen3",
                           "hf-stablelm"))
#: The held-out set (``--models held-out``): families no test under tests/planning/ uses
#: (tests/benchmarks/test_planner_held_out.py checks), so nothing is tuned on them. Two
#: mixture-of-experts decoders (Qwen3-MoE: top-k router and per-expert loops; GraniteMoE:
#: parallel experts in one grouped matmul), parallel attention + MLP with dropout on
#: (Falcon), parallel attention + MLP with partial rotary (GPT-J), parallel blocks with a
#: logit scale (Cohere), sandwich norms and soft-capped logits (Gemma 2).
HELD_OUT_RUNS: tuple[tuple[str, int], ...] = tuple(
    (name, 4) for name in ("ho-qwen3-moe", "ho-granitemoe", "ho-falcon", "ho-gptj",
                           "ho-cohere", "ho-gemma2"))
#: Family names of the held-out set, as a test would spell them.
HELD_OUT_FAMILIES = ("qwen3_moe", "qwen3moe", "granitemoe", "falcon", "gptj", "gpt-j",
                     "cohere", "gemma2")
#: Per held-out decoder: layers, hidden size, sequence length (the issue's range: 2-6
#: layers, d 64-128, seq 64-128).
HELD_OUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "ho-qwen3-moe": (4, 96, 64), "ho-granitemoe": (6, 64, 128), "ho-falcon": (3, 128, 128),
    "ho-gptj": (2, 128, 64), "ho-cohere": (6, 64, 64), "ho-gemma2": (2, 128, 128)}
HF_SEQ = 128
FRACTIONS = (0.25, 0.5, 0.75)
#: Issue #31's table (``--models families``): GPT-NeoX, Mixtral, OPT with dropout 0.1,
#: Qwen3-MoE and Falcon (parallel attention + MLP, dropout 0.1); then six families no test
#: and no other set here uses (``FAMILY_HELD_OUT``, checked by
#: tests/benchmarks/test_planner_held_out.py): BLOOM (ALiBi, fused QKV, dropout 0.1),
#: GPT-BigCode (multi-query, dropout 0.1), Starcoder2 (GQA, biases, residual dropout 0.1),
#: Persimmon (q/k layer norms, partial rotary, squared ReLU), CodeGen (parallel attention
#: + MLP, partial rotary), Nemotron (squared ReLU MLP, partial rotary). 6 layers, d 128,
#: seq 128.
FAMILY_RUNS: tuple[tuple[str, int], ...] = tuple(
    (name, 4) for name in ("fam-gpt-neox", "fam-mixtral", "fam-opt", "fam-qwen3-moe",
                           "fam-falcon", "fam-bloom", "fam-gpt-bigcode", "fam-starcoder2",
                           "fam-persimmon", "fam-codegen", "fam-nemotron"))
#: The families set's families that no test and no other set here uses.
FAMILY_HELD_OUT = ("bloom", "gpt_bigcode", "starcoder2", "persimmon", "codegen", "nemotron")
FAMILY_SECTION = "planner-families"
#: Decoders built from their ``model_type`` alone (``--models architectures``): one shared
#: tiny config (``ARCH_CONFIG``: 4 layers, d 128, 4 heads, 2 KV heads, 4 experts of which 2
#: per token where the family has experts) handed to ``transformers.AutoConfig.for_model``,
#: with no code per family, so any decoder transformers knows is added by its name; keys a
#: family does not read are ignored by its config. No planning test, generated draw or other
#: set here uses these families (tests/benchmarks/test_planner_held_out.py checks). Hybrids
#: whose state-space or linear-attention sizes this config does not set (Qwen3-Next,
#: Falcon-H1, Nemotron-H: their peaks at these keys run to gigabytes) are left out for size.
ARCH_TYPES = ("gemma3_text", "exaone4", "ernie4_5", "seed_oss", "gpt_oss", "llama4_text", "mpt",
              "biogpt", "olmo2", "olmo3", "apertus", "hunyuan_v1_dense", "lfm2", "helium",
              "smollm3", "glm", "arcee", "xglm", "glm4_moe", "minimax", "bitnet", "ministral",
              "cohere2", "ernie4_5_moe",
              "hunyuan_v1_moe", "phimoe", "doge", "vaultgemma", "flex_olmo", "afmoe")
ARCH_CONFIG: dict[str, object] = dict(
    vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=HF_SEQ,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, num_local_experts=4, num_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, sliding_window=64)
ARCH_RUNS: tuple[tuple[str, int], ...] = tuple((f"arch-{name}", 4) for name in ARCH_TYPES)
ARCH_SECTION = "planner-architectures"
#: Seeded random decoders (``--models generated``): tests/generated_models.py's draws
#: (family, depth 2-4, width, heads, dropout, tied head), batch 2 x 32 tokens.
GENERATED_SEEDS = tuple(range(100, 112))
GENERATED_SECTION = "planner-generated"


@dataclass
class Row:
    """One model at one budget."""

    model: str
    fraction: float
    plan: Plan
    best: FrontierPoint
    grad_error: float
    plan_s: float
    lower_bound_ms: float
    greedy_bound_ms: float

    @property
    def reduction(self) -> float:
        """1 - plan recompute / best manual recompute (0 when the best recomputes nothing)."""
        if self.best.recompute_ms == 0:
            return 0.0
        return float(1.0 - self.plan.recompute_ms / self.best.recompute_ms)

    @property
    def vs_best(self) -> float:
        """plan recompute / best manual recompute (0 when both are 0)."""
        if self.best.recompute_ms == 0:
            return 0.0 if self.plan.recompute_ms == 0 else float("inf")
        return float(self.plan.recompute_ms / self.best.recompute_ms)

    @property
    def vs_bound(self) -> float:
        """plan recompute / lower bound (1 when both are 0)."""
        if self.lower_bound_ms == 0:
            return 1.0 if self.plan.recompute_ms == 0 else float("inf")
        return float(self.plan.recompute_ms / self.lower_bound_ms)


def hf_model(name: str) -> torch.nn.Module:
    """A 6-layer Hugging Face decoder from a tiny config (held out: no test tunes on it)."""
    import transformers as tf

    common: dict[str, object] = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=6,
                                     num_attention_heads=4, intermediate_size=344,
                                     max_position_embeddings=HF_SEQ)
    torch.manual_seed(0)
    if name == "hf-llama":
        config: object = tf.LlamaConfig(num_key_value_heads=2, **common)
        model = tf.LlamaForCausalLM(config)  # type: ignore[arg-type]
    elif name == "hf-qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **common))
    elif name == "hf-gpt-neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    elif name == "hf-phi":
        model = tf.PhiForCausalLM(tf.PhiConfig(**common))
    elif name == "hf-gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1024, n_embd=128, n_layer=6,
                                                 n_head=4, n_positions=HF_SEQ))
    elif name == "hf-mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, **common))
    elif name == "hf-gemma":
        model = tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=2, head_dim=32,
                                                   **common))
    elif name == "hf-opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=1024, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
            ffn_dim=344, max_position_embeddings=HF_SEQ, word_embed_proj_dim=128))
    elif name == "hf-qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=32, **common))
    elif name == "hf-stablelm":
        model = tf.StableLmForCausalLM(tf.StableLmConfig(num_key_value_heads=2, **common))
    else:
        raise ValueError(name)
    model.config.use_cache = False
    model.train()
    return model


def held_out_model(name: str) -> torch.nn.Module:
    """A held-out decoder from a tiny config (``HELD_OUT_SHAPES``), random weights."""
    import transformers as tf

    layers, hidden, seq = HELD_OUT_SHAPES[name]
    common: dict[str, object] = dict(vocab_size=1024, hidden_size=hidden,
                                     num_hidden_layers=layers, num_attention_heads=4,
                                     intermediate_size=2 * hidden, max_position_embeddings=seq)
    tokens: dict[str, object] = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    config: object
    if name == "ho-qwen3-moe":
        config = tf.Qwen3MoeConfig(num_key_value_heads=2, head_dim=hidden // 4, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=hidden,
                                   **common)
    elif name == "ho-granitemoe":
        config = tf.GraniteMoeConfig(num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, **common)
    elif name == "ho-falcon":
        config = tf.FalconConfig(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=4, parallel_attn=True, bias=True,
                                 new_decoder_architecture=False, multi_query=True,
                                 hidden_dropout=0.1, attention_dropout=0.1,
                                 max_position_embeddings=seq, **tokens)
    elif name == "ho-gptj":
        config = tf.GPTJConfig(vocab_size=1024, n_embd=hidden, n_layer=layers, n_head=4,
                               rotary_dim=hidden // 8, n_positions=seq, **tokens)
    elif name == "ho-cohere":
        config = tf.CohereConfig(num_key_value_heads=2, **tokens, **common)
    elif name == "ho-gemma2":
        config = tf.Gemma2Config(num_key_value_heads=2, head_dim=hidden // 4,
                                 sliding_window=seq // 2, **tokens, **common)
    else:
        raise ValueError(name)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    model.train()
    return model


def family_model(name: str) -> torch.nn.Module:
    """One of the families set's decoders (``FAMILY_RUNS``), random weights, tiny config."""
    import transformers as tf

    common: dict[str, object] = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=6,
                                     num_attention_heads=4, max_position_embeddings=HF_SEQ)
    tokens: dict[str, object] = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    config: object
    if name == "fam-gpt-neox":
        config = tf.GPTNeoXConfig(intermediate_size=512, **common)
    elif name == "fam-mixtral":
        config = tf.MixtralConfig(intermediate_size=256, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2, **common)
    elif name == "fam-opt":
        config = tf.OPTConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=6,
                              num_attention_heads=4, ffn_dim=512, word_embed_proj_dim=128,
                              max_position_embeddings=HF_SEQ, dropout=0.1)
    elif name == "fam-qwen3-moe":
        config = tf.Qwen3MoeConfig(intermediate_size=256, num_key_value_heads=2, head_dim=32,
                                   num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=128, **common, **tokens)
    elif name == "fam-falcon":
        config = tf.FalconConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, parallel_attn=True,
                                 new_decoder_architecture=False, multi_query=True, bias=True,
                                 hidden_dropout=0.1, attention_dropout=0.1,
                                 max_position_embeddings=HF_SEQ, **tokens)
    elif name == "fam-bloom":
        config = tf.BloomConfig(vocab_size=1024, hidden_size=128, n_layer=6, n_head=4,
                                hidden_dropout=0.1, attention_dropout=0.1, **tokens)
    elif name == "fam-gpt-bigcode":
        config = tf.GPTBigCodeConfig(vocab_size=1024, n_embd=128, n_layer=6, n_head=4,
                                     n_positions=HF_SEQ, multi_query=True, **tokens)
    elif name == "fam-starcoder2":
        config = tf.Starcoder2Config(intermediate_size=512, num_key_value_heads=2,
                                     residual_dropout=0.1, **common, **tokens)
    elif name == "fam-persimmon":
        config = tf.PersimmonConfig(intermediate_size=512, **common, **tokens)
    elif name == "fam-codegen":
        config = tf.CodeGenConfig(vocab_size=1024, n_embd=128, n_layer=6, n_head=4,
                                  n_positions=HF_SEQ, rotary_dim=16, **tokens)
    elif name == "fam-nemotron":
        config = tf.NemotronConfig(intermediate_size=512, num_key_value_heads=2, **common,
                                   **tokens)
    else:
        raise ValueError(name)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    model.train()
    return model


def arch_model(model_type: str) -> torch.nn.Module:
    """The architectures set's decoder of ``model_type`` (``ARCH_TYPES``): ``ARCH_CONFIG``
    through ``AutoConfig.for_model``, random weights."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, **ARCH_CONFIG)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.config.use_cache = False
    model.train()
    return model


def hf_batch(batch_size: int, seq: int = HF_SEQ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def saved_graph(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                device: str = "h100-80gb") -> ForwardGraph:
    """The training step's forward as a graph over storages (benchmarks/_bound.py)."""
    free = [*model.parameters(), *model.buffers(), *batch.values()]
    # the head a chunked head replaces (a built-in model's ``lm_head`` too)
    graph = forward_graph(lambda: default_loss(call_model(model, batch)), free, device,
                          output_head(model))
    model.zero_grad(set_to_none=True)
    return graph


def bounds_ms(graph: ForwardGraph, need_bytes: int, head_freed_bytes: int | None = None
              ) -> tuple[float, float]:
    """``(lower bound, greedy bound)`` on the recompute that frees ``need_bytes``: the
    LP relaxation (chains) and the fractional knapsack (no chains), NOTE [ Lower bound ];
    a chunked head may free ``head_freed_bytes`` besides (NOTE [ A chunked head in the
    bound ] in benchmarks/_bound.py), which also places the bytes alive before the step,
    so that every moment of backward binds (NOTE [ Moments of backward in the bound ]).
    Both are valid, so the bound is the larger."""
    greedy = knapsack_bound_ms(graph, need_bytes, head_freed_bytes)
    return max(greedy, lp_bound_ms(graph, need_bytes, head_freed_bytes)), greedy


def head_freed_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                     graph: ForwardGraph) -> int:
    """At least the bytes a chunked head can take off the un-checkpointed peak besides saved
    storages: the peak less the bytes alive before the step and ``graph``'s saved storages
    (NOTE [ A chunked head in the bound ])."""
    none = profile(model, batch, timing=False)
    start = none.param_bytes + none.buffer_bytes + none.batch_bytes + none.optimizer_bytes
    return max(none.peak_bytes - start - graph.saved_bytes, 0)


def _command() -> str:
    root = HERE.parent
    python = Path(sys.executable)
    shown = str(python.relative_to(root)) if python.is_relative_to(root) else "python"
    script = Path(sys.argv[0]).resolve()
    script_text = str(script.relative_to(root)) if script.is_relative_to(root) else str(script)
    return shlex.join([shown, script_text, *sys.argv[1:]])


def _us(ms: float) -> str:
    return f"{ms * 1e3:.1f} us"


def model_and_batch(preset: str, batch_size: int
                    ) -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """The model, batch and display name of one run (``gen-<seed>`` adds its draw)."""
    torch.manual_seed(0)
    if preset.startswith("hf-"):
        model, batch = hf_model(preset), hf_batch(batch_size)
    elif preset.startswith("ho-"):
        model = held_out_model(preset)
        batch = hf_batch(batch_size, HELD_OUT_SHAPES[preset][2])
    elif preset.startswith("fam-"):
        model, batch = family_model(preset), hf_batch(batch_size)
    elif preset.startswith("arch-"):
        model, batch = arch_model(preset.removeprefix("arch-")), hf_batch(batch_size)
    elif preset.startswith("gen-"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        from generated_models import generated_model

        drawn = generated_model(int(preset.removeprefix("gen-")), batch_size=batch_size)
        model, batch = drawn.model, drawn.batch
        preset = f"{preset} ({drawn.label})"
    else:
        model = build_model(preset)
        model.train()
        batch = make_batch(model, batch_size)
    return model, batch, preset


def run_model(preset: str, batch_size: int, *, simulate: bool,
              log: list[str]) -> tuple[list[Row], Frontier]:
    """Measure the manual strategies and plan three budgets for one preset."""
    model, batch, preset = model_and_batch(preset, batch_size)
    label = f"{preset}, batch {batch_size}, seq {int(batch['input_ids'].shape[1])}"
    started = time.perf_counter()
    context = prepare(model, batch)
    prepare_s = time.perf_counter() - started
    manual = frontier(model, batch, budget_bytes=1, simulate=simulate, label=label)
    full, none = manual.point("full").peak_bytes, manual.point("none").peak_bytes
    graph = saved_graph(model, batch, manual.cost_device)
    head_bytes = head_freed_bytes(model, batch, graph)
    rows: list[Row] = []
    mid: Frontier | None = None
    for fraction in FRACTIONS:
        budget = int(full + fraction * (none - full))
        started = time.perf_counter()
        result = plan(model, batch, budget=budget, context=context, simulate=simulate)
        plan_s = prepare_s + time.perf_counter() - started
        fitting = [p for p in manual.points if p.peak_bytes <= budget]
        best = min(fitting, key=lambda p: (p.recompute_ms, p.peak_bytes))
        report = validate(model, batch, result)
        rows.append(Row(preset, fraction, result, best,
                        max(report.max_rel_error, report.loss_rel_error), plan_s,
                        *bounds_ms(graph, none - budget, head_bytes)))
        log.append(f"{preset} {fraction:.0%}: plan {_us(result.recompute_ms)} vs "
                   f"{best.name} {_us(best.recompute_ms)} ({rows[-1].vs_best:.2f}x; plan "
                   f"from {getattr(result, 'source', 'planner')}), "
                   f"lower bound {_us(rows[-1].lower_bound_ms)} ({rows[-1].vs_bound:.2f}x; greedy "
                   f"{_us(rows[-1].greedy_bound_ms)})")
        print(log[-1], flush=True)
        if fraction == 0.5:
            points = tuple(FrontierPoint(p.name, p.peak_bytes, p.recompute_flops,
                                         p.recompute_ms, p.overhead_pct,
                                         p.peak_bytes <= budget) for p in manual.points)
            plan_point = FrontierPoint(
                "plan", result.measured_or_predicted_peak_bytes, result.recompute_flops,
                result.recompute_ms, 100.0 * result.recompute_ms / manual.step_ms,
                result.measured_or_predicted_peak_bytes <= budget)
            mid = Frontier(points + (plan_point,), budget, manual.step_ms, manual.cost_device,
                           f"{label}, budget 50% of the way")
    if mid is None:
        raise RuntimeError("planner benchmark: the 50% budget was not planned")
    return rows, mid


def plan_seconds(n_layer: int, simulate: bool) -> tuple[float, float]:
    """Wall and CPU time of ``plan`` (everything included) at 50% for ``gpt-tiny`` with
    ``n_layer`` layers, d_model 128, seq 128, batch 4 (issue #11's timing model)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layer=n_layer, d_model=128, max_seq_len=128)
    batch = make_batch(model, 4)
    started, cpu = time.perf_counter(), time.process_time()
    plan(model, batch, budget="50%", simulate=simulate)
    return time.perf_counter() - started, time.process_time() - cpu


def throughput_seconds(simulate: bool) -> tuple[float, float, int]:
    """Wall and CPU time of ``plan_throughput(...)`` for ``gpt-small`` at 60% of the
    batch-8 peak, and the batch size it picks."""
    torch.manual_seed(0)
    model = build_model("gpt-small")
    started, cpu = time.perf_counter(), time.process_time()
    result = plan_throughput(model, lambda n: make_batch(model, n), budget="60%",
                             simulate=simulate)
    return time.perf_counter() - started, time.process_time() - cpu, int(result.batch_size or 0)


def render(rows: list[Row], fronts: list[Frontier], *, timings: dict[int, tuple[float, float]],
           elapsed_s: float, simulate: bool,
           throughput: tuple[float, float, int] | None = None,
           title: str = "Planner: cheapest plan under a budget vs the best manual strategy",
           plot: bool = True) -> str:
    """The markdown body of the planner section (``title``: its heading; ``plot``: link
    the frontier plot)."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    headers = ("Model", "Budget", "Plan peak (measured)", "Predicted", "Plan recompute",
               "Best manual that fits", "Its recompute", "Plan / best", "Greedy bound",
               "Lower bound", "Plan / bound", "Grad error", "Plan time", "Plan")
    table = []
    for r in rows:
        table.append([
            r.model, f"{r.fraction:.0%}: {format_bytes(r.plan.budget_bytes)}",
            format_bytes(r.plan.measured_or_predicted_peak_bytes),
            format_bytes(r.plan.predicted_peak_bytes),
            _us(r.plan.recompute_ms), f"{r.best.name} ({format_bytes(r.best.peak_bytes)})",
            _us(r.best.recompute_ms), f"{r.vs_best:.2f}x", _us(r.greedy_bound_ms),
            _us(r.lower_bound_ms),
            f"{r.vs_bound:.2f}x", f"{r.grad_error:.1e}",
            f"{r.plan_s:.1f} s", r.plan.label(),
        ])
    average = sum(r.reduction for r in rows) / max(1, len(rows))
    binding = [r for r in rows if r.best.recompute_ms > 0]
    vs_best = sum(r.vs_best for r in binding) / max(1, len(binding))
    bounded = [r for r in rows if r.lower_bound_ms > 0]
    vs_bound = sum(r.vs_bound for r in bounded) / max(1, len(bounded))
    worst = max(bounded, key=lambda r: r.vs_bound, default=None)
    fits = all(r.plan.measured_or_predicted_peak_bytes <= r.plan.budget_bytes for r in rows)
    beats = all(r.plan.recompute_ms <= r.best.recompute_ms for r in rows)
    below = all(r.lower_bound_ms <= min(r.plan.recompute_ms, r.best.recompute_ms) * (1 + 1e-6)
                for r in rows)  # a bound above a fitting plan would break its premise
    lines = [
        f"## {title}",
        "",
        f"Command: `{_command()}` (from the repository root; {elapsed_s:.0f} s in total).",
        f"Date: {now}.",
        "",
        f"- Platform: {platform.platform()}, Python {platform.python_version()}",
        f"- CPU: {_cpu_name()} ({os.cpu_count()} logical cores visible, torch threads: "
        f"{torch.get_num_threads()})",
        f"- torch {torch.__version__}; device: cpu; measurements: "
        f"{'simulated (FakeTensorMode)' if simulate else 'real'}",
        "",
        "Budgets are 25%, 50% and 75% of the way from the full-checkpoint peak to the "
        "no-checkpoint peak (whole training step: parameters, gradients, batch and "
        "activations; no optimizer). Recompute cost is the roofline time of every "
        "recomputed op with H100 figures (max of FLOPs / 67 TFLOP/s fp32 and bytes / "
        "3.35 TB/s). \"Best manual\" is the cheapest of none, full, every:N (all N), sqrt, "
        "attn, mlp and ops whose measured peak fits the budget. Plan peaks are the closed "
        "loop's measurement (on CPU a tracked step of the fake copy, byte-equal to a real "
        "step); \"Predicted\" is the peak model's "
        "prediction. Grad error: worst relative error of loss and gradients vs the "
        "un-checkpointed model (float32, dropout on). Plan time includes measuring the "
        "candidates and the closed loop.",
        "",
        markdown_table(headers, table),
        "",
        f"Plan recompute / best manual, averaged: **{vs_best:.2f}x**; plan / lower bound "
        f"(NOTE [ Lower bound ] in benchmarks/planner.py: the LP relaxation of freeing the "
        f"needed bytes of saved storages by re-running the ops that wrote them, their "
        f"inputs kept or re-run in turn, at the peak and at every moment of backward, a "
        f"chunked head's program beside; \"greedy\" is the same without chains), averaged: "
        f"**{vs_bound:.2f}x**"
        + (f" (worst: {worst.vs_bound:.2f}x, {worst.model} at {worst.fraction:.0%}). "
           if worst is not None else ". ") +
        f"Average recompute reduction vs the best manual strategy: **{average:.1%}** "
        f"(every plan fits its budget: {'yes' if fits else 'NO'}; every plan at most the "
        f"best manual cost: {'yes' if beats else 'NO'}; the bound at most every plan's "
        f"and every fitting manual strategy's recompute: {'yes' if below else 'NO'}).",
        "",
    ]
    for n_layer, (wall, cpu) in timings.items():
        lines += [f"Planning a {n_layer}-layer model (`gpt-tiny` with `n_layer={n_layer}, "
                  f"d_model=128, max_seq_len=128`, batch 4, budget 50%) end to end: "
                  f"{wall:.1f} s wall, {cpu:.1f} s CPU.", ""]
    if throughput is not None:
        wall, cpu, size = throughput
        lines += [f"Throughput search (`gpt-small`, `plan_throughput`, budget 60% of "
                  f"the batch-8 peak; picks batch {size}): {wall:.1f} s wall, {cpu:.1f} s CPU.",
                  ""]
    for front in fronts:
        lines += [f"### Frontier: {front.label} ({format_bytes(front.budget_bytes)})", "",
                  frontier_markdown(front), ""]
    if plot:
        lines += [f"![Peak memory vs recompute overhead]({PLOT.name})", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true",
                        help="measure under FakeTensorMode (same bytes on CPU, faster)")
    parser.add_argument("--models", choices=("builtin", "hf", "hf-more", "held-out", "all",
                                                  "families", "generated", "architectures", "none"),
                        default="all", help="built-in presets, held-out HF decoders, or both "
                        "(hf-more: six more HF decoders, not part of all; held-out: "
                        "families no planning test uses, written to their own section)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="the markdown file whose planner section is replaced")
    parser.add_argument("--timings", default="16,32",
                        help="layer counts to time planning for ('' for none)")
    parser.add_argument("--no-throughput", action="store_true",
                        help="skip timing the throughput search on gpt-small")
    parser.add_argument("--seeds", default="",
                        help="with --models generated: only these seeds, e.g. '100,110' "
                        "(default: all of GENERATED_SEEDS; write them with --results "
                        "elsewhere, the section is the whole set's)")
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip()) or GENERATED_SEEDS
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    rows: list[Row] = []
    fronts: list[Frontier] = []
    log: list[str] = []
    runs = {"builtin": RUNS, "hf": HF_RUNS, "hf-more": HF_MORE_RUNS, "all": RUNS + HF_RUNS,
            "held-out": HELD_OUT_RUNS, "families": FAMILY_RUNS,
            "generated": tuple((f"gen-{seed}", 2) for seed in seeds),
            "architectures": ARCH_RUNS,
            "none": ()}[args.models]
    held_out = args.models in ("held-out", "families", "generated", "architectures")
    for preset, batch_size in runs:
        model_rows, front = run_model(preset, batch_size, simulate=args.simulate, log=log)
        rows += model_rows
        fronts.append(front)
    if args.timings.strip():  # imports and first-call costs stay out of the timings
        plan_seconds(8, args.simulate)  # 2 layers do not fit 50%: BudgetTooSmall
    timings = {int(n): plan_seconds(int(n), args.simulate)
               for n in args.timings.split(",") if n.strip()}
    for n, (wall, cpu) in timings.items():
        print(f"plan, {n} layers: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    throughput = None if args.no_throughput else throughput_seconds(args.simulate)
    if throughput is not None:
        print(f"throughput search, gpt-small: {throughput[0]:.1f} s wall, "
              f"{throughput[1]:.1f} s CPU, batch {throughput[2]}", flush=True)
    elapsed_s = time.perf_counter() - started
    title, section = {
        "held-out": ("Planner on held-out decoders (families no planning test uses)",
                     HELD_OUT_SECTION),
        "families": ("Planner on issue #31's decoders and six held-out families (6 layers, "
                     "d 128, seq 128, batch 4)",
                     FAMILY_SECTION),
        "architectures": (f"Planner on {len(ARCH_TYPES)} decoders built from their model "
                          "type alone (4 layers, d 128, seq 128, batch 4)", ARCH_SECTION),
        "generated": ("Planner on seeded random decoders (tests/generated_models.py, seeds "
                      + (f"{seeds[0]}-{seeds[-1]})" if seeds == GENERATED_SEEDS
                         else ", ".join(map(str, seeds)) + ")"), GENERATED_SECTION),
    }.get(args.models, ("Planner: cheapest plan under a budget vs the best manual strategy",
                        SECTION))
    body = render(rows, fronts, timings=timings, elapsed_s=elapsed_s, simulate=args.simulate,
                  throughput=throughput, title=title, plot=not held_out)
    results: Path = args.results
    text = results.read_text() if results.exists() else ""
    results.write_text(replace_section(text, section, body))
    if results == RESULTS and fronts and not held_out:
        plot_frontier(fronts, PLOT)
    average = sum(r.reduction for r in rows) / max(1, len(rows))
    print(f"average reduction {average:.1%}; wrote {results} and {PLOT}")


if __name__ == "__main__":
    main()
