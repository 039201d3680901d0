"""``remat.profile`` against the CPU allocator on tiny vision, speech and attention models.

Prints, per model, the tracked peak, the allocator's peak of the same step (after a
warm-up step, from cleared gradients, with the bytes alive before it added back) and the
gap in percent: the check of NOTE [ Kernel scratch measured by probes ] in
src/remat/measure/scratch.py.

    PYTHONPATH=src python scripts/scratch_gap.py [--only vit,resnet] [--no-probes]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

from remat.measure import profile, scratch
from remat.measure.profile import allocator_step_peak
from remat.measure.step import Step, clear_grads, run_step

BATCH, IMAGE, CLASSES, SEQ, VOCAB, SAMPLES = 2, 32, 10, 32, 128, 1600


def _images(size: int = IMAGE) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
            "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}


def _tokens() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _vit() -> tuple[nn.Module, dict[str, Any]]:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        image_size=IMAGE, patch_size=4, num_labels=CLASSES)), _images()  # type: ignore[call-arg]


def _vit_224() -> tuple[nn.Module, dict[str, Any]]:
    """ViT's own image and patch sizes (224, 16) on a narrow model: the patch embedding's
    convolution scratch grows with the image, the rest with the width."""
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        image_size=224, patch_size=16, num_labels=CLASSES)), _images(224)  # type: ignore[call-arg]


def _mobilevit() -> tuple[nn.Module, dict[str, Any]]:
    return transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=IMAGE, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_labels=CLASSES)), _images()  # type: ignore[call-arg]


def _poolformer() -> tuple[nn.Module, dict[str, Any]]:
    return transformers.PoolFormerForImageClassification(transformers.PoolFormerConfig(
        depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 24, 32],
        num_labels=CLASSES)), _images()  # type: ignore[call-arg]


def _resnet() -> tuple[nn.Module, dict[str, Any]]:
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[2, 2, 2, 2],
        layer_type="basic", num_labels=CLASSES)), _images()  # type: ignore[call-arg]


def _wav2vec2() -> tuple[nn.Module, dict[str, Any]]:
    model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32,
        mask_time_prob=0.0))
    g = torch.Generator().manual_seed(0)
    return model, {"input_values": torch.randn(BATCH, SAMPLES, generator=g),
                   "labels": torch.randint(1, 32, (BATCH, 8), generator=g)}


def _led() -> tuple[nn.Module, dict[str, Any]]:
    model = transformers.LEDForConditionalGeneration(transformers.LEDConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, attention_window=[8], max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    return model, {"input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=g),
                   "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}


def _bigcode() -> tuple[nn.Module, dict[str, Any]]:
    return transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        multi_query=True)), _tokens()


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "vit": _vit, "vit_224": _vit_224, "mobilevit": _mobilevit, "poolformer": _poolformer,
    "resnet": _resnet,
    "wav2vec2": _wav2vec2, "led": _led, "gpt_bigcode": _bigcode,
}


def gap(model: nn.Module, batch: dict[str, Any]) -> tuple[int, int]:
    """(tracked peak, allocator peak) of the same training step, bytes."""
    prof = profile(model, batch, timing=False)
    static = prof.param_bytes + prof.buffer_bytes + prof.batch_bytes
    torch.manual_seed(0)
    clear_grads(model)
    run_step(model, batch)  # warm-up
    return prof.peak_bytes, allocator_step_peak(Step(model, batch), static)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--no-probes", action="store_true",
                        help="the tracker without probed scratch (the figure before probes)")
    options = parser.parse_args()
    names = [n for n in options.only.split(",") if n] or list(MODELS)
    if options.no_probes:
        scratch.MAX_PROBES = 0
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    print(f"{'model':<12} {'profile B':>11} {'allocator B':>12} {'gap':>9}")
    for name in names:
        torch.manual_seed(0)
        model, batch = MODELS[name]()
        model.train()
        tracked, allocated = gap(model, batch)
        print(f"{name:<12} {tracked:>11} {allocated:>12} "
              f"{100 * (tracked - allocated) / allocated:>+8.3f}%", flush=True)


if __name__ == "__main__":
    main()
