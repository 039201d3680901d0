"""Memory and FLOPs are exactly XLA's analysis of the same compiled step."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import remat.jax as rj
from remat.jax.analysis import compiler_options, default_loss

from .conftest import TINY, TINY_BATCH


def _xla(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[int, float]:
    """The step compiled independently, at XLA's default optimization level."""
    graphdef, state = nnx.split(model)

    def step(s: nnx.State, b: dict[str, jax.Array]) -> tuple[jax.Array, nnx.State]:
        return nnx.value_and_grad(default_loss)(nnx.merge(graphdef, s), b)

    compiled = jax.jit(step).lower(state, batch).compile(compiler_options=compiler_options())
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    return peak, compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("strategy", ["none", "dots_saveable"])
def test_peak_and_flops_equal_xla_analysis(strategy: str) -> None:
    model = rj.apply(rj.build_model(TINY), strategy)
    batch = rj.make_batch(TINY, TINY_BATCH)
    prof = rj.profile(model, batch)
    peak, flops = _xla(model, batch)
    assert prof.peak_bytes == peak, (
        f"{strategy}: profile {prof.peak_bytes} B != XLA {peak} B "
        f"(ratio {prof.peak_bytes / peak:.4f})")
    assert prof.flops == int(round(flops))
    a = rj.analyze_step(model, batch)
    assert a.peak_bytes == peak


def test_profile_shape_and_remat_effect() -> None:
    model = rj.build_model(TINY)
    batch = rj.make_batch(TINY, TINY_BATCH)
    none = rj.profile(model, batch)
    full = rj.profile(rj.apply(model, "full"), batch)
    assert [b.name for b in none.blocks] == ["blocks.0", "blocks.1"]
    assert none.recompute_flops == 0 and full.recompute_flops > 0
    assert full.peak_bytes < none.peak_bytes
    assert full.activation_bytes < none.activation_bytes
    assert full.blocks[0].saved_bytes < none.blocks[0].saved_bytes
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert none.param_bytes == params == none.grad_bytes
    assert none.forward_ms is None and none.ops == ()
    assert sum(none.peak_breakdown.values()) == none.peak_bytes
    assert none.peak_breakdown["parameters"] == none.peak_breakdown["gradients"] == params
    assert none.peak_breakdown["batch"] == none.batch_bytes


def test_cpu_barriers_kept() -> None:
    """Without the barrier fix XLA:CPU undoes remat; with it, the peak drops."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only behaviour")
    assert compiler_options() == {"xla_disable_hlo_passes": "cse_barrier_expander"}


class _TakesTheBatch(nnx.Module):
    """A model whose ``__call__`` takes the batch dict itself."""

    def __init__(self) -> None:
        self.inner = rj.build_model(TINY)

    def __call__(self, batch: dict[str, jax.Array]) -> jax.Array:
        return self.inner(**batch)


class _TakesOtherNames(nnx.Module):
    def __init__(self) -> None:
        self.inner = rj.build_model(TINY)

    def __call__(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return self.inner(input_ids=tokens, labels=targets)


def test_a_model_that_takes_the_batch_dict_is_called_with_it() -> None:
    batch = rj.make_batch(TINY, TINY_BATCH)
    wrapped = rj.profile(_TakesTheBatch(), batch)
    plain = rj.profile(rj.build_model(TINY), batch)
    assert wrapped.peak_bytes == plain.peak_bytes and wrapped.flops == plain.flops


def test_a_dict_the_model_cannot_take_says_how_remat_called_it_and_the_fix() -> None:
    batch = rj.make_batch(TINY, TINY_BATCH)
    with pytest.raises(TypeError) as info:
        default_loss(_TakesOtherNames(), batch)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("remat.jax: cannot call _TakesOtherNames(tokens")
    assert "model(**batch)" in str(info.value) and "loss_fn=" in lines[-1]
    prof = rj.profile(_TakesOtherNames(), batch,
                      loss_fn=lambda m, b: m(b["input_ids"], b["labels"]))
    assert prof.peak_bytes == rj.profile(rj.build_model(TINY), batch).peak_bytes
