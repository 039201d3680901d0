"""remat with the tools people train with: FSDP2, torch.compile, Hugging Face transformers.

Submodules are imported on demand (``from remat.integrations.fsdp2 import apply_fsdp``):
``fsdp2`` needs ``torch.distributed``, ``hf`` needs ``transformers`` (``pip install
'remat[hf]'``), so importing this package imports neither.
"""

__all__ = ["compile", "fsdp2", "hf"]
