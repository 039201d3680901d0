"""The strategies remat ships, one module each (a config and its handler); the registry
registers them in this order."""

from remat.strategies.builtin.chunked_head import ChunkedHead, ChunkedHeadHandler
from remat.strategies.builtin.every import EveryN, EveryNHandler
from remat.strategies.builtin.full import Full, FullHandler
from remat.strategies.builtin.full_offload import FullOffload, FullOffloadHandler
from remat.strategies.builtin.none import NoCheckpoint, NoCheckpointHandler
from remat.strategies.builtin.offload import Offload, OffloadHandler
from remat.strategies.builtin.ops import SelectiveOps, SelectiveOpsHandler
from remat.strategies.builtin.sqrt import SqrtSegments, SqrtSegmentsHandler
from remat.strategies.builtin.sublayer import Attention, AttentionHandler, Mlp, MlpHandler

#: Registration order: the order of every default strategy list. Each config type with
#: its handler.
BUILTIN_HANDLERS = ((NoCheckpoint, NoCheckpointHandler), (Full, FullHandler),
                    (EveryN, EveryNHandler), (SqrtSegments, SqrtSegmentsHandler),
                    (Attention, AttentionHandler), (Mlp, MlpHandler),
                    (SelectiveOps, SelectiveOpsHandler), (Offload, OffloadHandler),
                    (FullOffload, FullOffloadHandler), (ChunkedHead, ChunkedHeadHandler))

#: The built-in config types, in registration order.
BUILTIN = tuple(config for config, _ in BUILTIN_HANDLERS)

__all__ = ["BUILTIN", "BUILTIN_HANDLERS", "Attention", "ChunkedHead", "EveryN", "Full",
           "FullOffload", "Mlp", "NoCheckpoint", "Offload", "SelectiveOps", "SqrtSegments"]
