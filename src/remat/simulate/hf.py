"""Hugging Face models from their config classes, on the meta device, no weights.

Simulation needs only the architecture: ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` builds a Llama-7B in about a second without allocating or
downloading anything; :func:`remat.measure.profile` with ``simulate=True`` turns its
parameters into fake tensors of the same dtype.

``transformers`` is an optional dependency (``pip install 'remat[hf]'``) imported
only when one of these functions runs.

NOTE [ Training settings of built HF models ]
Models are built the way they are trained: ``use_cache=False`` (a KV cache is for
generation; with checkpointing it breaks recomputation) and the ``sdpa`` attention
implementation (fused attention, the default of recent transformers versions; pass
``attn_implementation="eager"`` to see the memory of a materialised attention
matrix). Both can be overridden.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.errors import message

# Short names people type -> transformers ``model_type`` (keys of CONFIG_MAPPING).
# Any other model_type transformers knows is accepted as is.
HF_ALIASES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "mixtral": "mixtral",
    "gpt2": "gpt2",
    "gpt-neox": "gpt_neox",
    "qwen": "qwen2",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "phi": "phi",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "opt": "opt",
    "falcon": "falcon",
}

_INSTALL_HINT = "pip install 'remat[hf]'"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(message(
            "remat.simulate.hf", "Hugging Face models need the transformers package, which is "
            "not installed", fix=f"install it with: {_INSTALL_HINT}")) from exc
    return transformers


def _resolve_model_type(name: str) -> str:
    transformers = _transformers()
    mapping = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    key = name.strip().lower()
    model_type = HF_ALIASES.get(key, key)
    if model_type not in mapping:
        model_type = model_type.replace("-", "_")
    if model_type not in mapping:
        raise ValueError(message(
            "remat.simulate.hf", f"unknown Hugging Face model {name!r}",
            {"short names": ", ".join(sorted(HF_ALIASES))},
            fix="use a short name or any transformers model_type, or build the config "
                "yourself and call hf_model_from_config(config)"))
    return str(model_type)


def hf_config_from_name(name: str, **overrides: Any) -> Any:
    """The transformers config of a model family, with default or given sizes.

    Args:
        name: a short name from :data:`HF_ALIASES` (``"llama"``, ``"gpt2"``, ...) or any
            transformers ``model_type``.
        **overrides: config fields to set, e.g. ``num_hidden_layers=2``.

    Returns:
        A ``transformers.PretrainedConfig`` with ``use_cache=False`` unless overridden.

    Example:
        >>> hf_config_from_name("llama", num_hidden_layers=2).num_hidden_layers
        2
    """
    transformers = _transformers()
    settings: dict[str, Any] = {"use_cache": False}
    settings.update(overrides)
    return transformers.AutoConfig.for_model(_resolve_model_type(name), **settings)


def hf_model_from_config(config: Any, *, dtype: torch.dtype | None = None,
                         device: str | torch.device = "meta",
                         attn_implementation: str = "sdpa") -> nn.Module:
    """Build ``AutoModelForCausalLM.from_config(config)`` without allocating weights.

    Args:
        config: a transformers config.
        dtype: parameter dtype. Default: ``None``, float32 (the config's ``dtype`` is
            ignored, as ``from_config`` does).
        device: where parameters live. Default: ``"meta"`` (nothing allocated; what
            :func:`remat.measure.profile` with ``simulate=True`` expects).
        attn_implementation: ``"sdpa"`` (fused, default) or ``"eager"``.

    Returns:
        The model in train mode.

    Example:
        >>> cfg = hf_config_from_name("gpt2", n_layer=2)
        >>> hf_model_from_config(cfg).transformer.h[0].attn.c_attn.weight.device
        device(type='meta')
    """
    transformers = _transformers()
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    if getattr(model, "loss_type", "") is None:
        # transformers falls back to ForCausalLM's loss for causal LMs whose class name it
        # does not map (GPT2LMHeadModel), with a warning the user cannot act on; say so
        # explicitly: the same loss, no warning.
        model.loss_type = "ForCausalLM"
    model.train()
    return model  # type: ignore[no-any-return]


def hf_model_from_name(name: str, *, dtype: torch.dtype | None = None,
                       device: str | torch.device = "meta", attn_implementation: str = "sdpa",
                       **overrides: Any) -> nn.Module:
    """Build a Hugging Face causal LM from its config class, on the meta device.

    Default sizes are the config class's defaults (``"llama"`` is Llama-2-7B sized,
    ``"mistral"`` Mistral-7B, ``"gpt2"`` GPT-2 small, ``"qwen2"`` a 7B-class Qwen2);
    pass any config field to change them. No weights are downloaded or allocated.

    Args:
        name: short name (see :data:`HF_ALIASES`) or transformers ``model_type``.
        dtype: parameter dtype. Default: ``None`` (float32).
        device: Default: ``"meta"``.
        attn_implementation: Default: ``"sdpa"``.
        **overrides: config fields, e.g. ``num_hidden_layers=4, hidden_size=1024``.

    Example:
        >>> model = hf_model_from_name("llama", num_hidden_layers=2, dtype=torch.bfloat16)
        >>> type(model).__name__, next(model.parameters()).is_meta
        ('LlamaForCausalLM', True)
    """
    return hf_model_from_config(hf_config_from_name(name, **overrides), dtype=dtype,
                                device=device, attn_implementation=attn_implementation)


def hf_config_from_file(path: str | Path, **overrides: Any) -> Any:
    """Read a ``config.json`` (file or its directory) into its transformers config class.

    The file must name its ``model_type`` (every config.json on the Hub does). Nothing
    is fetched from the network. ``use_cache`` is set to False unless overridden.

    Args:
        path: a ``config.json`` file or a directory holding one.
        **overrides: config fields to change after loading.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file has no ``model_type`` or names an unknown one.

    Example:
        >>> hf_config_from_file("llama-3-8b/config.json").hidden_size  # doctest: +SKIP
        4096
    """
    transformers = _transformers()
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise FileNotFoundError(message(
            "remat.simulate.hf", f"no config file at {str(path)!r}",
            fix="pass the path of a config.json (or of the directory holding it)"))
    data = json.loads(file.read_text())
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(message(
            "remat.simulate.hf", f"{str(file)!r} has no 'model_type' field",
            {"so": "its config class is unknown"},
            fix='add e.g. "model_type": "llama" to the file'))
    data["use_cache"] = False
    data.update(overrides)
    return transformers.AutoConfig.for_model(_resolve_model_type(str(model_type)), **data)


def hf_model_from_config_file(path: str | Path, *, dtype: torch.dtype | None = None,
                              device: str | torch.device = "meta",
                              attn_implementation: str = "sdpa",
                              **overrides: Any) -> nn.Module:
    """Build a Hugging Face causal LM from a ``config.json`` (file or its directory).

    See :func:`hf_config_from_file`; nothing is fetched from the network.

    Args:
        path: a ``config.json`` file or a directory holding one.
        dtype, device, attn_implementation: as in :func:`hf_model_from_config`.
        **overrides: config fields to change after loading.

    Example:
        >>> model = hf_model_from_config_file("llama-3-8b/config.json")  # doctest: +SKIP
    """
    return hf_model_from_config(hf_config_from_file(path, **overrides), dtype=dtype,
                                device=device, attn_implementation=attn_implementation)


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` (or a module inside it) is a transformers ``PreTrainedModel``."""
    return any(type(m).__module__.startswith("transformers.") and hasattr(m, "config")
               for m in model.modules())


# NOTE [ HF masks under FakeTensorMode ]
#   Rule: a simulated Hugging Face step builds the attention masks a real eager step of
#   the same batch builds. transformers' mask code (``masking_utils``) calls
#   ``find_packed_sequence_indices(position_ids)`` when a training batch has no 2-D
#   attention mask and no cache: it looks at the *values* of ``position_ids`` to see
#   whether several sequences are packed in one row, and returns ``None`` (one sequence
#   per row, the causal mask alone) when the check ``(mask[:, -1] == 0).all()`` holds.
#   Under FakeTensorMode tensors hold no values, so that check cannot run (it is skipped
#   as when tracing), the packed-sequence indices are kept, and the simulated step builds
#   a packed-sequence mask a real step never builds: more bytes than the real step.
#   remat's simulated batches hold one sequence per row (``position_ids`` an arange per
#   row, or none), for which the real check returns ``None``, so
#   :func:`unpacked_sequences` makes the detection return ``None`` while simulating.
#   tests/simulate/test_hf.py (test_simulating_an_hf_model_equals_a_real_cpu_run) checks
#   a simulated Hugging Face step against a real CPU step.


@contextmanager
def unpacked_sequences() -> Iterator[None]:
    """While active, transformers assumes batches hold one sequence per row.

    See NOTE [ HF masks under FakeTensorMode ]: makes simulated Hugging Face steps
    allocate what a real eager step allocates. A no-op without transformers or
    when its mask code has no packed-sequence detection.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def no_packing(position_ids: torch.Tensor) -> None:
        return None

    masking_utils.find_packed_sequence_indices = no_packing
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
