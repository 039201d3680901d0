"""Which calls a save set frees from recompute, and the save-set chains that use it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.core.op_record import OpRecord
from remat.devices import get_device
from remat.strategies.builtin.ops import save_set_chain
from remat.strategies.dead_ops import supported
from remat.strategies.op_graph import OpGraph, block_graphs

pytestmark = pytest.mark.skipif(not supported(), reason="SAC without storage by call index")
H100 = get_device("h100-80gb")


class Mlp(nn.Module):
    """fc1, Hugging Face's gelu_new (or ``act``), fc2."""

    def __init__(self, act: str = "tanh") -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.act = getattr(torch, act)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        c = math.sqrt(2.0 / math.pi)
        # mul#0, pow, mul#1, add#0, mul#2, act, add#1, mul#3
        return self.fc2(0.5 * h * (1.0 + self.act(c * (h + 0.044715 * h.pow(3.0)))))


class Block(nn.Module):
    def __init__(self, act: str = "tanh") -> None:
        super().__init__()
        self.mlp = Mlp(act)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(x)


def _graphs(act: str = "tanh") -> dict[str, OpGraph]:
    with FakeTensorMode():
        block, x = Block(act), torch.randn(4, 8, requires_grad=True)
        return block_graphs(block, (x,), {}, {"mlp": block.mlp})


def test_caching_tanh_frees_the_chain_before_it() -> None:
    graphs = _graphs()
    assert set(graphs) == {"", "mlp"}
    chain = {("aten.pow", 0), ("aten.mul", 1), ("aten.add", 0), ("aten.mul", 2)}
    assert set(graphs["mlp"].freed(["aten.tanh"])) == chain
    # Named per call, the same; the block's own graph counts the residual add too.
    assert set(graphs["mlp"].freed(["aten.tanh#0"])) == chain
    assert set(graphs[""].freed(["aten.tanh"])) == chain
    # fc1's output is read by ops that run: caching fc2's input frees nothing before it.
    assert graphs["mlp"].freed(["aten.addmm#0"]) == []


def test_an_op_that_saves_its_input_frees_nothing() -> None:
    assert _graphs("sin")["mlp"].freed(["aten.sin"]) == []


def test_save_set_chain_ranks_an_entry_with_the_calls_it_frees() -> None:
    def op(name: str, read: int, write: int = 512, flops: int = 0) -> OpRecord:
        return OpRecord(name, "forward", flops, read, write)

    ops = [op("aten.addmm", 1_152, 512, 2 * 4 * 8 * 32),  # fc1, (4, 32) fp32 out
           op("aten.mul", 512), op("aten.pow", 512), op("aten.mul", 512),
           op("aten.add", 1_024), op("aten.mul", 512), op("aten.tanh", 512),
           op("aten.add", 512), op("aten.mul", 1_024),
           op("aten.addmm", 1_024 + 32 * 8 * 4, 128, 2 * 4 * 32 * 8)]  # fc2
    graph = _graphs()["mlp"]
    heavy = {"aten.addmm", "aten.addmm#0", "aten.addmm#1"}

    def light(with_graph: OpGraph | None = None) -> set[str]:
        return set(save_set_chain(ops, H100, max_light_ops=1, graph=with_graph)[-1]) - heavy

    # By own time per byte the adds (one reads two tensors) rank first; with the four
    # calls it frees, tanh is worth five pointwise ops.
    assert light() == {"aten.add"}
    assert light(graph) == {"aten.tanh"}
