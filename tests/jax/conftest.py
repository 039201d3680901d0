"""Shared tiny NNX models for the remat.jax tests (compiles are the cost: keep them small)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from remat.jax.models import GPTConfig  # noqa: E402

#: Two blocks: every test compiles steps of this model, so it is as small as it can be.
TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=32)
#: Two blocks, activation-heavy (long sequence), for the planner.
PLANNER = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=64)
TINY_BATCH = 2
PLANNER_BATCH = 4
