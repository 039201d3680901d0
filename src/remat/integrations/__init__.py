"""remat with the tools people train with: FSDP2, torch.compile, Hugging Face transformers
(and TRL, PEFT, accelerate through it), PyTorch Lightning, tensor parallelism (DTensor),
pipeline stages (``torch.distributed.pipelining``; a rank's interleaved chunks planned together).

Submodules are imported on demand (``from remat.integrations.fsdp2 import apply_fsdp``):
``fsdp2`` needs ``torch.distributed``, ``hf`` needs ``transformers`` (``pip install
'remat[hf]'``), ``lightning`` needs ``lightning`` (``pip install 'remat[lightning]'``), so
importing this package imports none of them.
"""

__all__ = ["compile", "fsdp2", "hf", "lightning", "pipeline", "pipeline_rank", "tp"]
