"""remat with the tools people train with: FSDP2, torch.compile, Hugging Face transformers
(and TRL, PEFT, accelerate through it), PyTorch Lightning, tensor parallelism (DTensor).

Submodules are imported on demand (``from remat.integrations.fsdp2 import apply_fsdp``):
``fsdp2`` needs ``torch.distributed``, ``hf`` needs ``transformers`` (``pip install
'remat[hf]'``), ``lightning`` needs ``lightning`` (``pip install 'remat[lightning]'``), so
importing this package imports none of them. Each is a thin adapter: the per-rank layouts
and models of parallel training (the tensor-parallel layout ``tp`` applies, the FSDP
per-rank arithmetic ``fsdp2`` prices with) and pipeline stages live in
:mod:`remat.distributed`.
"""

__all__ = ["compile", "fsdp2", "hf", "lightning", "tp"]
