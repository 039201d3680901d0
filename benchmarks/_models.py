"""The models the fit benchmarks run on: tiny Hugging Face configs of named families and
seeded random decoders (tests/generated_models.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1] / "tests"
for _path in (_TESTS, _TESTS / "measure"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def named_and_generated(named: Sequence[str], seeds: Sequence[int]
                        ) -> list[tuple[str, torch.nn.Module, dict[str, torch.Tensor]]]:
    """``(label, model, batch)`` for each family in ``named`` (batch 2, 32 tokens) and each
    generated decoder of ``seeds``, labelled ``"generated <seed>: <config>"``."""
    import hf_tiny

    from generated_models import generated_model

    found = []
    for arch in named:
        model, batch = hf_tiny.build_hf(arch, batch_size=2, seq=32)
        found.append((arch, model, batch))
    for seed in seeds:
        drawn = generated_model(seed)
        found.append((f"generated {seed}: {drawn.label}", drawn.model, drawn.batch))
    return found
