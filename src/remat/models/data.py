"""Random token batches for the built-in models."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from remat.errors import message
from remat.models.gpt import GPTConfig
from remat.models.llama import LlamaConfig
from remat.models.presets import get_config

_API = "remat.models.make_batch"


def _config_of(source: nn.Module | GPTConfig | LlamaConfig | str) -> GPTConfig | LlamaConfig:
    if isinstance(source, str):
        return get_config(source)
    if isinstance(source, (GPTConfig, LlamaConfig)):
        return source
    config = getattr(source, "config", None)
    if not isinstance(config, (GPTConfig, LlamaConfig)):
        raise TypeError(message(
            _API, "expected a built-in model, a GPTConfig/LlamaConfig or a preset name",
            {"found": f"{type(source).__name__} (its .config is {type(config).__name__})"},
            fix="for other models build the batch yourself"))
    return config


def _device_of(source: object) -> torch.device:
    if isinstance(source, nn.Module):
        for p in source.parameters():
            return p.device
    return torch.device("cpu")


def make_batch(
    source: nn.Module | GPTConfig | LlamaConfig | str,
    batch_size: int,
    seq_len: int | None = None,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """A batch of uniformly random token ids with next-token labels.

    Tokens come from a ``torch.Generator`` seeded with ``seed`` (the global RNG is untouched),
    so the same arguments always give the same batch. ``labels`` is a copy of ``input_ids``;
    the models shift it themselves.

    Args:
        source: a built-in model, its config, or a preset name.
        batch_size: sequences per batch, >= 1.
        seq_len: tokens per sequence, 2 <= seq_len <= max_seq_len.
            Default: the config's ``max_seq_len``.
        seed: generator seed. Default: 0.
        device: where to put the batch. Default: the model's parameter device, else CPU.

    Returns:
        ``{"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}``, so
        ``model(**batch).loss`` works.

    Example::

        >>> batch = make_batch("gpt-tiny", batch_size=2, seq_len=16)
        >>> batch["input_ids"].shape
        torch.Size([2, 16])
    """
    config = _config_of(source)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(message(_API, "batch_size must be an integer >= 1",
                                 {"found": repr(batch_size)}, fix="pass batch_size >= 1"))
    if seq_len is None:
        seq_len = config.max_seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(message(
            _API, "seq_len must be an integer >= 2", {"found": repr(seq_len)},
            fix="pass seq_len >= 2 (next-token loss needs two tokens)"))
    if seq_len > config.max_seq_len:
        raise ValueError(message(
            _API, f"seq_len={seq_len} exceeds the model's max_seq_len={config.max_seq_len}",
            fix=f"pass seq_len<={config.max_seq_len} or override max_seq_len when building "
                "the model"))
    target = torch.device(device) if device is not None else _device_of(source)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len),
                              generator=generator, device="cpu")  # (B, T)
    if target.type != "cpu":
        input_ids = input_ids.to(target)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
