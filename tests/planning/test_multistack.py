"""Models with several stacks of blocks that do not run in registration order.

A two-tower model (CLIP: a text tower registered first, a vision tower run first) used
to get a false ``BlocksNotFound`` ("blocks [...] were not called"): the input capture
stopped at the last block in registration order. The peak model also counted saved
bytes in registration order, so its prediction missed what the first-run tower keeps.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import remat
from remat.planning.capture import capture_inputs


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _TwoTower(nn.Module):
    """``text`` is registered first; ``vision`` runs first; contrastive-style loss."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.text = nn.ModuleList(_Block(width) for _ in range(2))
        self.vision = nn.ModuleList(_Block(width) for _ in range(2))

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        for block in self.vision:
            image = block(image)
        for block in self.text:
            text = block(text)
        return (text @ image.T).logsumexp(-1).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g)


def test_capture_sees_every_block_whatever_order_the_towers_run_in() -> None:
    model = _TwoTower()
    blocks = remat.find_blocks(model)
    named = [(n, m) for n, m in model.named_modules() if any(m is b for b in blocks)]
    inputs = capture_inputs(model, _batch(), named)
    assert sorted(inputs) == sorted(n for n, _ in named)
    assert list(inputs) == ["vision.0", "vision.1", "text.0", "text.1"]  # call order


def _peaks(model: nn.Module, batch: object) -> tuple[int, int]:
    none_peak = remat.profile(model, batch, timing=False).peak_bytes
    remat.apply(model, "full")
    full_peak = remat.profile(model, batch, timing=False).peak_bytes
    remat.remove(model)
    return none_peak, full_peak


def test_a_two_tower_model_is_planned_and_predicted_in_forward_order() -> None:
    torch.manual_seed(0)
    model, batch = _TwoTower().train(), _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak, full_peak = _peaks(model, batch)
        plan = remat.plan(model, batch, budget=(none_peak + full_peak) // 2)
    assert plan.block_names == ("vision.0", "vision.1", "text.0", "text.1")
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes == plan.measured_peak_bytes, (
        f"predicted {plan.predicted_peak_bytes} B, measured {plan.measured_peak_bytes} B")
    assert remat.validate(model, batch, plan).passed


def test_clip_with_contrastive_loss_is_planned_end_to_end() -> None:
    transformers = pytest.importorskip("transformers")
    text = transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
        pad_token_id=1)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=8)
    config = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                     projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(2, 64, (16, 16), generator=g),
             "pixel_values": torch.randn(16, 3, 16, 16, generator=g), "return_loss": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        none_peak, full_peak = _peaks(model, batch)
        assert full_peak < none_peak
        plan = remat.plan(model, batch, budget=(none_peak + full_peak) // 2)
    assert {n.split(".")[0] for n in plan.block_names} == {"text_model", "vision_model"}
    assert plan.block_names[0].startswith("vision_model")  # CLIP runs its vision tower first
    assert plan.measured_peak_bytes is not None
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert not plan.is_empty
    assert remat.validate(model, batch, plan).passed
