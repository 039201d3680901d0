"""profile_compiled / measure_compiled: compiled steps measured without disturbing them.

Compiles are slow on CPU, so every compiled model is built once per module (fixtures)
and the model is tiny: two residual MLP blocks between an input and an output layer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.compiled.graphs import (
    CompiledGraph,
    CountingBackend,
    GraphLog,
    backend_of,
    counting_runs,
)
from remat.compiled.install import compile_blocks_with_budget, compile_with_budget
from remat.compiled.measure import (
    compiled_regions,
    dynamo_graph_count,
    is_compiled,
    measure_compiled,
    profile_compiled,
)
from remat.core.cost import Category
from remat.measure.allocator import allocator_peak
from remat.measure.step import clear_grads, run_step
from tiny_nets import Block, D
from tiny_nets import net as _net

BATCH = torch.randn(64, D, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def eager() -> remat.Profile:
    return remat.profile(_net(), BATCH, timing=False)


@pytest.fixture(scope="module")
def whole() -> nn.Module:
    return compile_with_budget(_net(), 1.0)


@pytest.fixture(scope="module")
def blocks_zero() -> nn.Module:
    return compile_blocks_with_budget(_net(), 0.0)


def _peak(model: nn.Module) -> int:
    clear_grads(model)
    peak = allocator_peak(lambda: run_step(model, BATCH)).peak_bytes
    clear_grads(model)
    return peak


def test_budget_one_flops_equal_eager(whole: nn.Module, eager: remat.Profile) -> None:
    m = measure_compiled(whole, BATCH, timing=False)
    assert m.counted and m.regions == ("",)
    assert m.profile.flops == eager.flops
    assert m.profile.forward_flops == eager.forward_flops
    assert m.profile.recompute_flops == 0
    kinds = sorted(g.kind for g in m.graphs)
    assert kinds == ["backward", "forward"]
    assert m.profile.blocks == ()  # whole-model compile: bytes not attributable to blocks
    assert m.profile.ops == ()


def test_compiled_peak_is_allocator_peak_plus_static(whole: nn.Module) -> None:
    m = measure_compiled(whole, BATCH, timing=False)
    p = m.profile
    static = p.param_bytes + p.buffer_bytes + p.optimizer_bytes + p.batch_bytes
    assert p.peak_bytes == static + m.allocator.peak_bytes
    assert p.peak_bytes == static + _peak(whole)
    assert 0 < p.activation_bytes < m.allocator.peak_bytes
    assert p.grad_bytes == sum(q.numel() * 4 for q in whole.parameters())
    assert p.peak_phase == "backward"
    assert set(p.peak_breakdown) <= set(Category)  # NOTE [ Categories of each backend ]
    assert sum(p.peak_breakdown.values()) == p.peak_bytes
    assert p.peak_breakdown[Category.STEP_TEMPORARIES] == m.allocator.peak_bytes


def test_profiling_leaves_compiled_model_untouched(whole: nn.Module) -> None:
    before_peak = _peak(whole)
    graphs = dynamo_graph_count()
    logged = len(backend_of(whole).log)  # type: ignore[union-attr]
    m = measure_compiled(whole, BATCH, timing=True, repeats=1)
    assert m.new_graphs == 0
    assert m.profile.step_ms is not None
    assert dynamo_graph_count() == graphs
    assert len(backend_of(whole).log) == logged  # type: ignore[union-attr]
    assert _peak(whole) == before_peak


def test_budget_zero_per_block(blocks_zero: nn.Module, eager: remat.Profile) -> None:
    m = measure_compiled(blocks_zero, BATCH, timing=False)
    p = m.profile
    assert m.counted and m.regions == ("blocks.0", "blocks.1")
    assert p.recompute_flops > 0
    assert p.flops == eager.flops + p.recompute_flops  # recompute is the only extra work
    assert [b.name for b in p.blocks] == ["blocks.0", "blocks.1"]
    per_block = p.blocks[0]
    assert per_block.recompute_flops == p.recompute_flops // 2
    # fc1 and fc2 forward: 2 * (2 * 64 * 64 * 256)
    assert per_block.forward_flops == 2 * 2 * 64 * D * 4 * D
    assert m.new_graphs == 0


def test_gradients_match_eager(blocks_zero: nn.Module) -> None:
    ref = _net()
    run_step(ref, BATCH)
    clear_grads(blocks_zero)
    run_step(blocks_zero, BATCH)
    for (name, a), b in zip(ref.named_parameters(), blocks_zero.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    clear_grads(blocks_zero)


def test_each_budget_gets_its_own_graphs() -> None:
    """The trap: recompiling the same module at another budget must not reuse graphs."""
    torch.manual_seed(0)
    block = Block()
    first = compile_with_budget(block, 1.0)
    run_step(first, BATCH)
    second = compile_with_budget(block, 0.0)
    run_step(second, BATCH)
    log1, log2 = backend_of(first).log, backend_of(second).log  # type: ignore[union-attr]
    assert log1.recompute_flops == 0
    assert log2.recompute_flops > 0
    assert {g.budget for g in log2.graphs} == {0.0}


def test_user_compiled_model_is_measured_uncounted(eager: remat.Profile) -> None:
    model = torch.compile(_net(), backend="aot_eager")
    m = measure_compiled(model, BATCH, timing=False)  # type: ignore[arg-type]
    assert not m.counted and m.graphs == ()
    assert m.profile.flops == eager.flops  # eager FLOPs of the region, say counted=False
    assert m.new_graphs == 0


def test_is_compiled_and_regions() -> None:
    net = _net()
    assert not is_compiled(net)
    assert compiled_regions(net) == []
    assert is_compiled(torch.compile(net))
    net.blocks[1].compile()
    assert [name for name, _ in compiled_regions(net)] == ["blocks.1"]
    inplace = _net()
    inplace.compile()
    assert compiled_regions(inplace) == [("", inplace)]


def test_errors() -> None:
    with pytest.raises(ValueError, match="no compiled module"):
        profile_compiled(_net(), BATCH)
    with pytest.raises(ValueError, match=r"budget must be in \[0, 1\]"):
        compile_with_budget(_net(), 1.5)
    with pytest.raises(ValueError, match="backend= is not accepted"):
        compile_with_budget(_net(), 0.5, backend="eager")
    with pytest.raises(ValueError, match="are not blocks"):
        compile_blocks_with_budget(_net(), {"blocks.7": 0.5})
    with pytest.raises(ValueError, match=r"budget for 'blocks.0' must be in"):
        compile_blocks_with_budget(_net(), {"blocks.0": -0.1})
    with pytest.raises(ValueError, match="budget must be in"):
        CountingBackend(2.0)
    with pytest.raises(ValueError, match=r"(?s)^CompiledGraph: unknown kind.*fix: pass one of"):
        CompiledGraph("x", "sideways", 0, 0, 0, 1.0, 0)


def test_eval_mode_refused() -> None:
    model = compile_with_budget(_net(), 1.0)
    model.eval()
    with pytest.raises(ValueError, match="eval mode"):
        profile_compiled(model, BATCH)


def test_partial_block_budgets_compile_only_named(eager: remat.Profile) -> None:
    net = compile_blocks_with_budget(_net(), {"blocks.1": 1.0})
    assert [name for name, _ in compiled_regions(net)] == ["blocks.1"]
    p = profile_compiled(net, BATCH, timing=False)
    assert p.flops == eager.flops
    assert [b.name for b in p.blocks] == ["blocks.1"]




def test_benchmark_quick(tmp_path: Path) -> None:
    """benchmarks/compile.py --quick runs end to end and writes its table.

    remat.plan_compiled's candidates are narrowed to none@1 and full@1 and its
    whole-model settings to 1.0 (2 + 1 compiles instead of 9 + 4): every path of the
    script still runs, as the table checked below shows (a plan_compiled row of the
    whole model compiled and one of a per-block candidate).
    """
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compile.py"
    spec = importlib.util.spec_from_file_location("bench_compile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    out = tmp_path / "compile.md"
    # main() raises dynamo's recompile limit for its many variants: put it back after
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        assert module.main(["--quick", "--candidates", "none@1,full@1", "--whole-budgets",
                            "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "compile, budget 0" in text and "remat plan" in text
    assert "new graphs while measuring" not in text
    # both kinds of plan_compiled row: the whole model compiled, and a per-block plan
    assert "whole model compiled at 1" in text and "; full@1 |" in text


def test_region_that_never_compiled_is_flagged_eager(eager: remat.Profile) -> None:
    from remat.compiled.graphs import register_backend

    net = _net()
    net.blocks[0].compile(backend="eager")  # a backend that is not the registered one
    register_backend(net.blocks[0], CountingBackend(1.0, label="blocks.0"))
    m = measure_compiled(net, BATCH, timing=False)
    assert m.eager_regions == ("blocks.0",)
    assert not m.counted
    assert m.profile.flops == eager.flops


def test_identical_blocks_share_one_backend() -> None:
    net = compile_blocks_with_budget(_net(), 0.5)
    assert backend_of(net.blocks[0]) is backend_of(net.blocks[1])
    mixed = compile_blocks_with_budget(_net(), {"blocks.0": 0.5, "blocks.1": 1.0})
    assert backend_of(mixed.blocks[0]) is not backend_of(mixed.blocks[1])


def test_remat_profile_measures_a_compiled_model_as_it_runs(whole: nn.Module) -> None:
    """#10 item 1: remat.profile on a compiled model = the compiled step, model left compiled."""
    _peak(whole)  # (re)compiles if an earlier test reset dynamo
    before_peak = _peak(whole)
    graphs = dynamo_graph_count()
    prof = remat.profile(whole, BATCH, timing=False)
    assert prof.peak_bytes == measure_compiled(whole, BATCH, timing=False).profile.peak_bytes
    assert dynamo_graph_count() == graphs  # no recompiles, no eager fallback
    assert _peak(whole) == before_peak
    sim = remat.profile(whole, BATCH, simulate=True)  # #10 item 3: see test_simulate.py
    assert sim.simulated and sim.peak_bytes == prof.peak_bytes
    assert _peak(whole) == before_peak


class _SignatureBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        if extra is not None:
            x = x + extra
        return x + self.fc2(torch.relu(self.fc1(x)))


class _TwoSignatures(nn.Module):
    """Two identical blocks (one shared backend) called with different signatures."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_SignatureBlock(d), _SignatureBlock(d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x, x), None).sum()


def test_graph_runs_are_counted_not_assumed() -> None:
    # NOTE [ Counting graph runs ]: the shared backend holds two graph pairs (one per
    # signature); each block ran one pair, so the compiled FLOPs equal the eager ones.
    from remat.compiled.install import compile_blocks_with_budget
    from remat.compiled.measure import measure_compiled

    torch.manual_seed(0)
    model, x = _TwoSignatures(), torch.randn(16, 32)
    eager = remat.profile(model, x, loss_fn=lambda out, b: out, timing=False)
    compile_blocks_with_budget(model, 1.0)
    got = measure_compiled(model, x, loss_fn=lambda out, b: out, timing=False)
    assert len(got.graphs) == 4
    assert got.profile.flops == eager.flops
    assert sum(b.forward_flops for b in got.profile.blocks) == eager.forward_flops
    assert got.counted


def test_a_graph_compiled_to_a_plain_function_is_logged_uncounted() -> None:
    # Inductor returns make_boxed_func(gm.forward) for a graph without ops (torch 2.11's
    # partitioner left one in the mlp@1 candidate): patching the built-in function type's
    # __call__ raised TypeError, and remat.plan(compile=True) dropped the candidate.
    class Compiled:
        def __call__(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
            return args

    def boxed(args: list[torch.Tensor]) -> list[torch.Tensor]:
        return args

    graph = CompiledGraph(label="m", kind="backward", flops=0, recompute_flops=0,
                          saved_bytes=0, budget=1.0, nodes=0, uncounted_ops=0)
    compiled, log = Compiled(), GraphLog()
    log.append(graph, boxed)
    log.append(graph, compiled)
    assert [a for _, a in log.artifacts()] == [None, compiled]
    with counting_runs([log]) as runs:
        boxed([])
        compiled([])
    assert runs == {id(graph): 1}
