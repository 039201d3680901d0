"""Write the Hugging Face compatibility matrix: gradient parity and memory per strategy.

For each transformers architecture, built from a small config with random weights on
the CPU (no downloads), and each remat strategy:

* gradient parity: ``remat.validate`` (loss and every parameter gradient against the
  un-checkpointed model, same weights, batch and RNG seed; dropout on as configured),
  PASS when the worst relative error is <= 1e-6;
* memory: ``remat.profile`` (exact storage-level bytes of one training step, no
  optimizer): the peak and the activation bytes (alive when backward starts), as a
  change against strategy ``none``;
* simulation: the peak of ``remat.profile(..., simulate=True)`` (fake tensors) against
  the real step's, exact bytes, without checkpointing and under ``full``: equal on CPU.

An architecture that cannot be built or profiled, a strategy that is refused or fails, and
a simulation that raises are recorded in the table (footnotes give the error) and the run
goes on; the exit status is 1 when anything failed or a simulated peak differs.

The tables go goes to stdout and into docs/compat.md between the markers
``<!-- compat:start -->`` and ``<!-- compat:end -->`` (the file is created if missing).

Usage::

    .venv/bin/python scripts/compat_matrix.py                 # all, a few minutes on 2 CPU cores
    .venv/bin/python scripts/compat_matrix.py --archs gpt2,mixtral --no-write
"""

from __future__ import annotations

import argparse
import os
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

from remat.blocks import named_blocks
from remat.measure import profile
from remat.strategies import apply, remove
from remat.units import format_bytes
from remat.validation import validate

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "compat.md"
START, END = "<!-- compat:start -->", "<!-- compat:end -->"
STRATEGIES = ("full", "every:2", "sqrt", "attn", "mlp", "ops", "offload")
SIM_STRATEGIES = ("none", "full")  # real vs simulated peak
RTOL = 1e-6
BATCH, SEQ, VOCAB = 4, 128, 512
MAMBA_SEQ = 32  # the CPU scan runs token by token
IMAGE, CLASSES = 32, 10
MELS, FRAMES = 16, 128  # Whisper's encoder halves the frames: 64 positions
LAYERS, HIDDEN, FFN, HEADS = 4, 128, 512, 4


def _causal(config_class: Any, **extra: Any) -> Callable[[], nn.Module]:
    """A decoder LM from ``config_class`` at the matrix's size (``extra`` overrides)."""
    def build() -> nn.Module:
        sizes = {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "intermediate_size": FFN,
                 "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2,
                 "vocab_size": VOCAB, "max_position_embeddings": SEQ}
        config = config_class(**{**sizes, **extra})
        return transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]
    return build


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=LAYERS, n_embd=HIDDEN, n_inner=FFN, n_head=HEADS, n_positions=SEQ,
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))


def _opt() -> nn.Module:
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, ffn_dim=FFN, num_attention_heads=HEADS,
        vocab_size=VOCAB, max_position_embeddings=SEQ, word_embed_proj_dim=HIDDEN))


def _falcon() -> nn.Module:
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ))


def _mamba() -> nn.Module:
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, state_size=16, expand=2, conv_kernel=4,
        vocab_size=VOCAB))


def _masked_lm(model_class: Any, config_class: Any, **extra: Any) -> Callable[[], nn.Module]:
    """An encoder with a masked-LM head (RoBERTa needs 2 extra positions: pad offset)."""
    def build() -> nn.Module:
        return model_class(config_class(  # type: ignore[no-any-return]
            num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
            num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ + 2,
            **extra))
    return build


def _distilbert() -> nn.Module:
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        n_layers=LAYERS, dim=HIDDEN, hidden_dim=FFN, n_heads=HEADS, vocab_size=VOCAB,
        max_position_embeddings=SEQ))


def _deberta() -> nn.Module:
    # problem_type is explicit: the default single-label path selects labelled rows with
    # (labels >= 0).nonzero(), a shape that depends on values, which simulate=True refuses.
    return transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
        num_attention_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ,
        relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=32,
        max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True,
        position_biased_input=False, num_labels=CLASSES,
        problem_type="single_label_classification"))


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=LAYERS // 2, num_decoder_layers=LAYERS // 2, d_model=HIDDEN, d_ff=FFN,
        d_kv=HIDDEN // HEADS, num_heads=HEADS, vocab_size=VOCAB, decoder_start_token_id=0,
        pad_token_id=0))  # type: ignore[call-arg]


def _bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=LAYERS // 2, decoder_layers=LAYERS // 2, d_model=HIDDEN,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, vocab_size=VOCAB, max_position_embeddings=SEQ))


def _whisper() -> nn.Module:
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        encoder_layers=LAYERS // 2, decoder_layers=LAYERS // 2, d_model=HIDDEN,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, vocab_size=VOCAB, num_mel_bins=MELS,
        max_source_positions=FRAMES // 2, max_target_positions=SEQ, decoder_start_token_id=0,
        pad_token_id=0, bos_token_id=0, eos_token_id=0))


def _vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=FFN,
        num_attention_heads=HEADS, image_size=IMAGE, patch_size=4,
        num_labels=CLASSES))  # type: ignore[call-arg]


def _clip() -> nn.Module:
    tower = {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "intermediate_size": FFN,
             "num_attention_heads": HEADS}
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config={**tower, "vocab_size": VOCAB, "max_position_embeddings": SEQ},
        vision_config={**tower, "image_size": IMAGE, "patch_size": 4}, projection_dim=64))


def _resnet() -> nn.Module:
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2],
        layer_type="basic", num_labels=CLASSES))


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _tokens(seq: int = SEQ) -> Callable[[], dict[str, Any]]:
    """Language modelling: ids, an all-ones mask, labels = ids (the model shifts them)."""
    def batch() -> dict[str, Any]:
        ids = torch.randint(1, VOCAB, (BATCH, seq), generator=_generator())
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return batch


def _seq2seq(*, mask: bool) -> Callable[[], dict[str, Any]]:
    """Encoder ids (SEQ) and decoder labels (SEQ / 2); the model shifts labels right."""
    def batch() -> dict[str, Any]:
        g = _generator()
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        out = {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
        return {**out, "attention_mask": torch.ones_like(ids)} if mask else out
    return batch


def _classify() -> dict[str, Any]:
    g = _generator()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _images() -> dict[str, Any]:
    g = _generator()
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _speech() -> dict[str, Any]:
    """Log-mel features (B, mels, frames) and decoder labels."""
    g = _generator()
    return {"input_features": torch.randn(BATCH, MELS, FRAMES, generator=g),
            "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}


def _image_text() -> dict[str, Any]:
    """Captions and images; ``return_loss=True``: CLIP's own contrastive loss."""
    g = _generator()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
            "return_loss": True}


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix: how to build it, a batch for it, what kind it is."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    family: str


_MOE = {"num_experts_per_tok": 2, "output_router_logits": True}
ARCHS: dict[str, Arch] = {
    "gpt2": Arch("GPT-2", _gpt2, _tokens(), "decoder"),
    "llama": Arch("Llama", _causal(transformers.LlamaConfig), _tokens(), "decoder"),
    "mistral": Arch("Mistral", _causal(transformers.MistralConfig), _tokens(), "decoder"),
    "qwen2": Arch("Qwen2", _causal(transformers.Qwen2Config), _tokens(), "decoder"),
    "gemma": Arch("Gemma", _causal(transformers.GemmaConfig, head_dim=HIDDEN // HEADS),
                  _tokens(), "decoder"),
    "phi": Arch("Phi", _causal(transformers.PhiConfig), _tokens(), "decoder"),
    "gpt_neox": Arch("GPT-NeoX", _causal(transformers.GPTNeoXConfig), _tokens(), "decoder"),
    "falcon": Arch("Falcon", _falcon, _tokens(), "decoder"),
    "opt": Arch("OPT", _opt, _tokens(), "decoder"),
    "mixtral": Arch("Mixtral", _causal(transformers.MixtralConfig, num_local_experts=4,
                                       **_MOE), _tokens(), "MoE decoder"),
    "qwen2_moe": Arch("Qwen2-MoE", _causal(
        transformers.Qwen2MoeConfig, num_experts=4, moe_intermediate_size=FFN // 2,
        shared_expert_intermediate_size=FFN // 2, **_MOE), _tokens(), "MoE decoder"),
    "olmoe": Arch("OLMoE", _causal(transformers.OlmoeConfig, num_experts=4, **_MOE),
                  _tokens(), "MoE decoder"),
    "mamba": Arch("Mamba", _mamba, _tokens(MAMBA_SEQ), "state-space LM"),
    "bert": Arch("BERT", _masked_lm(transformers.BertForMaskedLM, transformers.BertConfig),
                 _tokens(), "encoder"),
    "roberta": Arch("RoBERTa", _masked_lm(transformers.RobertaForMaskedLM,
                                          transformers.RobertaConfig, pad_token_id=0),
                    _tokens(), "encoder"),
    "distilbert": Arch("DistilBERT", _distilbert, _tokens(), "encoder"),
    "deberta_v2": Arch("DeBERTa-v2", _deberta, _classify, "disentangled-attention encoder"),
    "t5": Arch("T5", _t5, _seq2seq(mask=False), "encoder-decoder"),
    "bart": Arch("BART", _bart, _seq2seq(mask=True), "encoder-decoder"),
    "whisper": Arch("Whisper", _whisper, _speech, "speech encoder-decoder"),
    "vit": Arch("ViT", _vit, _images, "vision encoder"),
    "clip": Arch("CLIP", _clip, _image_text, "two-tower contrastive"),
    "resnet": Arch("ResNet", _resnet, _images, "CNN with BatchNorm"),
}


@dataclass(frozen=True)
class Cell:
    """One strategy on one architecture."""

    status: str  # "PASS", "FAIL", "n/a" (refused with a clear error) or "ERROR"
    max_rel_error: float | None = None
    peak_change: float | None = None  # (peak - peak_none) / peak_none
    activation_change: float | None = None
    note: str = ""


@dataclass(frozen=True)
class SimCheck:
    """The peak of one strategy measured for real and simulated (fake tensors), bytes."""

    real_bytes: int | None
    simulated_bytes: int | None = None
    note: str = ""  # the error when the simulation (or the real run) failed

    @property
    def equal(self) -> bool:
        return self.real_bytes is not None and self.real_bytes == self.simulated_bytes


@dataclass(frozen=True)
class ArchResult:
    """One architecture: blocks found, the ``none`` peak, a Cell per strategy, sim checks."""

    blocks: list[str] = field(default_factory=list)
    peak_bytes: int = 0
    cells: dict[str, Cell] = field(default_factory=dict)
    sim: dict[str, SimCheck] = field(default_factory=dict)
    error: str = ""  # the model could not be built or profiled at all

    @property
    def ok(self) -> bool:
        """No FAIL/ERROR cell, no architecture error, simulation equal wherever it ran."""
        return (not self.error and all(c.status in ("PASS", "n/a") for c in self.cells.values())
                and all(check.equal for check in self.sim.values()))


def build(arch: Arch) -> nn.Module:
    """``arch``'s model in train mode, seed 0, with its KV cache off.

    ``remat.apply`` turns ``config.use_cache`` off (recomputing a block would append to the
    cache twice), so the baseline is measured the same way: with the cache on, GPT-NeoX's
    un-checkpointed peak is 2 MiB (8%) lower, and every strategy would look that much worse.
    """
    torch.manual_seed(0)
    model = arch.build().train()
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
    return model


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}"


def _simulated(model: nn.Module, batch: dict[str, Any], real_bytes: int) -> SimCheck:
    try:
        return SimCheck(real_bytes, profile(model, batch, simulate=True).peak_bytes)
    except Exception as exc:  # recorded in the table, the other architectures go on
        return SimCheck(real_bytes, note=first_line(exc))


def run_arch(arch: Arch, strategies: tuple[str, ...],
             sim_strategies: tuple[str, ...] = SIM_STRATEGIES) -> ArchResult:
    """Parity and memory per strategy; real vs simulated peak for ``sim_strategies``.

    Never raises: an architecture that cannot be built or profiled comes back with
    ``error`` set, a strategy that fails or is refused as a Cell saying so.
    """
    try:
        model = build(arch)
        batch = arch.batch()
        blocks = [name for name, _ in named_blocks(model)]
        base = profile(model, batch, timing=False)
    except Exception as exc:
        return ArchResult(error=first_line(exc))
    sim: dict[str, SimCheck] = {}
    if "none" in sim_strategies:
        sim["none"] = _simulated(model, batch, base.peak_bytes)
    cells: dict[str, Cell] = {}
    for strategy in dict.fromkeys((*strategies, *(s for s in sim_strategies if s != "none"))):
        try:
            report = validate(model, batch, strategy, rtol=RTOL) if strategy in strategies else None
        except (ValueError, LookupError) as exc:  # refused up front: BlocksNotFound, ...
            cells[strategy] = Cell("n/a", note=first_line(exc))
            continue
        except Exception as exc:  # failed while running
            cells[strategy] = Cell("ERROR", note=first_line(exc))
            continue
        try:
            apply(model, strategy)
        except Exception as exc:  # a sim-only strategy that cannot be applied
            sim[strategy] = SimCheck(None, note=first_line(exc))
            continue
        try:
            prof = profile(model, batch, timing=False)
            if strategy in sim_strategies:
                sim[strategy] = _simulated(model, batch, prof.peak_bytes)
        finally:
            remove(model)
        if report is not None:
            cells[strategy] = Cell(
                "PASS" if report.passed else "FAIL", report.max_rel_error,
                (prof.peak_bytes - base.peak_bytes) / base.peak_bytes,
                (prof.activation_bytes - base.activation_bytes) / max(base.activation_bytes, 1),
                "" if report.passed else f"worst parameter {report.worst_param}",
            )
    return ArchResult(blocks, base.peak_bytes, cells, sim)


def _pct(x: float | None) -> str:
    if x is None:
        return ""
    percent = round(x * 100)
    return "0%" if percent == 0 else f"{percent:+d}%".replace("-", "−")


def _exact(num_bytes: int | None) -> str:
    return "" if num_bytes is None else f"{num_bytes:,}"


def _sim_cell(check: SimCheck | None, notes: list[str], label: str) -> list[str]:
    """Real bytes, simulated bytes, and "yes" / the difference / a footnote."""
    if check is None:
        return ["", "", ""]
    if check.note:
        notes.append(f"{label}: {check.note}")
        return [_exact(check.real_bytes), f"ERROR [{len(notes)}]", "no"]
    assert check.real_bytes is not None and check.simulated_bytes is not None
    diff = check.simulated_bytes - check.real_bytes
    return [_exact(check.real_bytes), _exact(check.simulated_bytes),
            "yes" if diff == 0 else f"NO ({diff:+,} B)"]


def render(results: dict[str, ArchResult], strategies: tuple[str, ...], seconds: float,
           sim_strategies: tuple[str, ...] = SIM_STRATEGIES) -> str:
    """The parity/memory table, the simulated-vs-real table, the legend and footnotes."""
    lines = [
        "| model | blocks found | peak (none) | " + " | ".join(f"`{s}`" for s in strategies)
        + " | worst grad error |",
        "|---|---|---|" + "---|" * len(strategies) + "---|",
    ]
    notes: list[str] = []
    for key, result in results.items():
        name = ARCHS[key].name
        if result.error:
            notes.append(f"{name}: {result.error}")
            cells_text = [f"ERROR [{len(notes)}]"] + [""] * (len(strategies) + 2)
            lines.append("| " + " | ".join([name, *cells_text]) + " |")
            continue
        row = [name, _blocks_label(result.blocks), format_bytes(result.peak_bytes)]
        for strategy in strategies:
            cell = result.cells[strategy]
            if cell.status in ("PASS", "FAIL"):
                text = f"{cell.status} {_pct(cell.peak_change)} ({_pct(cell.activation_change)})"
            else:
                notes.append(f"{name} `{strategy}`: {cell.note}")
                text = f"{cell.status} [{len(notes)}]"
            row.append(text)
        errors = [c.max_rel_error for c in result.cells.values() if c.max_rel_error is not None]
        row.append(f"{max(errors):.1e}" if errors else "")
        lines.append("| " + " | ".join(row) + " |")
    sim_lines = [
        "| model | kind | " + " | ".join(
            f"`{s}` real | `{s}` simulated | equal" for s in sim_strategies) + " |",
        "|---|---|" + "---|---|---|" * len(sim_strategies),
    ]
    for key, result in results.items():
        if result.error:
            continue
        arch = ARCHS[key]
        row = [arch.name, arch.family]
        for strategy in sim_strategies:
            row += _sim_cell(result.sim.get(strategy), notes, f"{arch.name} `{strategy}` simulated")
        sim_lines.append("| " + " | ".join(row) + " |")
    legend = [
        "",
        f"Cell: gradient parity (PASS: loss and every gradient within {RTOL:g} relative "
        "error of the un-checkpointed model), then the step's peak memory change and, in "
        "parentheses, the activation memory change against `none` (exact bytes from "
        "`remat.profile`, one training step without optimizer). `offload` keeps activations "
        "in host memory, so on a CPU-only run it changes nothing.",
        "",
        "Simulated vs real peak, exact bytes: `remat.profile(model, batch, simulate=True)` "
        "(fake tensors, nothing allocated) against `remat.profile(model, batch)` (the real "
        "step, storage-level tracker), without checkpointing and under `full`. On a CPU the "
        "two must be equal to the byte.",
        "",
        *sim_lines,
        "",
        f"Models: random weights from small configs ({LAYERS} blocks, hidden {HIDDEN}, MLP "
        f"{FFN}, {HEADS} heads; encoder-decoders {LAYERS // 2} + {LAYERS // 2} blocks; MoE "
        f"4 experts, top-2, router auxiliary loss on; CLIP {LAYERS} + {LAYERS} blocks; ResNet "
        f"4 stages of 2 basic blocks), batch {BATCH} x {SEQ} tokens (Mamba {MAMBA_SEQ}: its "
        f"CPU scan is sequential; decoder labels {SEQ // 2}), {IMAGE}x{IMAGE} images "
        f"(ViT/CLIP: 64 patches), Whisper {MELS} mel bins x {FRAMES} frames, float32, dropout "
        "as configured, `use_cache` off (as `remat.apply` sets it), each model's own loss "
        "from its labels (CLIP: `return_loss=True`); "
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{platform.machine()} CPU ({cpu_label()}), {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"{seconds:.0f} s. Produced by `python scripts/compat_matrix.py`.",
    ]
    if notes:
        legend += ["", *(f"[{i}] {note}" for i, note in enumerate(notes, 1))]
    return "\n".join(lines + legend)


def cpu_label() -> str:
    """The CPU model and core count, for the doc's provenance line."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _blocks_label(blocks: list[str]) -> str:
    stacks: dict[str, int] = {}
    for name in blocks:
        stacks[name.rsplit(".", 1)[0]] = stacks.get(name.rsplit(".", 1)[0], 0) + 1
    return " + ".join(f"`{stack}` x{n}" for stack, n in stacks.items())


def write(table: str, path: Path = DOC) -> None:
    """Put ``table`` between the markers of ``path`` (created with a title if missing)."""
    if path.exists():
        text = path.read_text()
    else:
        text = ("# Compatibility with Hugging Face transformers\n\n"
                f"{START}\n{END}\n")
    if START not in text or END not in text:
        raise SystemExit(f"compat_matrix.py: {path} lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def quiet() -> None:
    """One thread (tiny ops), and no expected notices (use_cache, offload on CPU, BatchNorm)."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS),
                        help=f"comma-separated, from {', '.join(ARCHS)} (default: all)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--no-write", action="store_true", help=f"do not update {DOC.name}")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.archs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ARCHS]
    if unknown:
        parser.error(f"unknown architectures {unknown}; choose from {', '.join(ARCHS)}")
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    quiet()
    start = time.perf_counter()
    results = {}
    for key in keys:
        t0 = time.perf_counter()
        results[key] = run_arch(ARCHS[key], strategies)
        status = "ok" if results[key].ok else "NOT ok"
        print(f"{ARCHS[key].name}: {time.perf_counter() - t0:.1f} s, {status}", file=sys.stderr,
              flush=True)
    table = render(results, strategies, time.perf_counter() - start)
    print(table)
    if not args.no_write:
        write(table)
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0 if all(result.ok for result in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
