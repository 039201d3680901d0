"""The strategies remat ships, one module each; the registry registers them in this order."""

from remat.strategies.builtin.chunked_head import ChunkedHead
from remat.strategies.builtin.every import EveryN
from remat.strategies.builtin.full import Full
from remat.strategies.builtin.full_offload import FullOffload
from remat.strategies.builtin.none import NoCheckpoint
from remat.strategies.builtin.offload import Offload
from remat.strategies.builtin.ops import SelectiveOps
from remat.strategies.builtin.sqrt import SqrtSegments
from remat.strategies.builtin.sublayer import Attention, Mlp

#: Registration order: the order of every default strategy list.
BUILTIN = (NoCheckpoint, Full, EveryN, SqrtSegments, Attention, Mlp, SelectiveOps, Offload,
           FullOffload, ChunkedHead)

__all__ = ["BUILTIN", "Attention", "ChunkedHead", "EveryN", "Full", "FullOffload", "Mlp",
           "NoCheckpoint", "Offload", "SelectiveOps", "SqrtSegments"]
