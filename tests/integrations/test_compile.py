"""Per-block torch.compile after remat.apply: gradients unchanged, SAC tags reach the compiler.

The backend is AOTAutograd with the partitioner inductor uses
(``min_cut_rematerialization_partition``) and eager kernels, so the test sees the joint
graph's recompute tags and what the compiled forward saves, without inductor's C++ build
(tens of seconds on CPU).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from remat.errors import StrategyError
from remat.integrations.compile import compile_blocks
from remat.models import build_model, make_batch
from remat.strategies import apply
from remat.validation import relative_error


class Capture:
    """An AOTAutograd backend that records each block graph's tags and saved values."""

    def __init__(self) -> None:
        self.tags: list[dict[str, Any]] = []  # per joint graph: node name -> (op, policy)
        self.saved: list[list[str]] = []  # per forward graph: names of saved values

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: Any,
                  **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        self.tags.append({n.name: (str(n.target), n.meta.get("recompute"))
                          for n in joint.graph.nodes if n.op == "call_function"})
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        output = next(n for n in forward.graph.nodes if n.op == "output")
        self.saved.append([str(a) for a in output.args[0]])
        return forward, backward

    def backend(self) -> Any:
        from functorch.compile import make_boxed_func

        def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=self.partition)


def _grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model(**batch).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _compiled_run(strategy: str) -> tuple[Capture, float, nn.Module]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    batch = make_batch(model, 2, 16, seed=1)
    reference = _grads(copy.deepcopy(model), batch)
    capture = Capture()
    compile_blocks(apply(model, strategy), backend=capture.backend())
    grads = _grads(model, batch)
    worst = max(relative_error(grads[n], reference[n]) for n in reference)
    return capture, worst, model


def test_op_level_plan_tags_reach_the_compiler_and_grads_are_unchanged() -> None:
    capture, worst, model = _compiled_run("ops")
    assert worst <= 1e-6
    assert list(model.state_dict()) == list(build_model("llama-tiny").state_dict())
    assert capture.tags, "the blocks were not compiled"
    tags = capture.tags[0]
    # Forward nodes of the region carry a policy; backward nodes of the joint graph do not.
    forward = {name: (op, policy) for name, (op, policy) in tags.items() if policy is not None}
    mms = [n for n, (op, _) in forward.items() if op == "aten.mm.default"]
    assert len(mms) == 7  # q, k, v, o, gate, up, down
    assert all(forward[n][1] == CheckpointPolicy.MUST_SAVE for n in mms)
    sdpa = [n for n, (op, _) in forward.items() if "scaled_dot_product" in op]
    assert sdpa and all(forward[n][1] == CheckpointPolicy.MUST_SAVE for n in sdpa)
    silu = [n for n, (op, _) in forward.items() if op == "aten.silu.default"]
    assert silu and all(forward[n][1] == CheckpointPolicy.PREFER_RECOMPUTE for n in silu)
    # The compiled forward saves the matmul outputs backward needs (all but the last
    # projection's, which only feeds the residual add) and recomputes the pointwise ops.
    saved = set(capture.saved[0])
    assert set(mms[:-1]) <= saved
    assert not saved & set(silu)


def test_full_checkpoint_compiles_and_saves_no_intermediate() -> None:
    capture, worst, _ = _compiled_run("full")
    assert worst <= 1e-6
    tags = capture.tags[0]
    mms = {n for n, (op, policy) in tags.items() if op == "aten.mm.default" and policy is not None}
    assert mms and not mms & set(capture.saved[0])


def test_sqrt_segments_are_refused_with_the_alternatives() -> None:
    model = apply(build_model("llama-tiny", n_layer=4), "sqrt")  # segments of 2
    with pytest.raises(StrategyError,
                       match="(?s)part of a 'sqrt' segment.*fix: use 'full', 'every:N'"):
        compile_blocks(model)
