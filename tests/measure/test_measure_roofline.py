"""roofline_ms: per-op max(compute, memory) time on a device, summed."""

from __future__ import annotations

import pytest
import torch

from remat.devices import DEVICES, DeviceSpec
from remat.measure import OpRecord, profile, roofline_ms

# A made-up device with round numbers: 100 TFLOP/s bf16, 10 TFLOP/s fp32, 1 TB/s.
DEV = DeviceSpec("round", 10**10, 100e12, 10e12, 1e12, 1e10)


def test_compute_bound_op_uses_the_dtype_peak():
    mm_bf16 = OpRecord("aten.mm", "forward", flops=10**12, read_bytes=10**6, write_bytes=0,
                       dtype_bytes=2)
    mm_fp32 = OpRecord("aten.mm", "forward", flops=10**12, read_bytes=10**6, write_bytes=0,
                       dtype_bytes=4)
    assert roofline_ms([mm_bf16], DEV) == pytest.approx(10.0)  # 1e12 / 100e12 s
    assert roofline_ms([mm_fp32], DEV) == pytest.approx(100.0)  # 1e12 / 10e12 s
    assert roofline_ms([mm_fp32], DEV, dtype_bytes=2) == pytest.approx(10.0)


def test_memory_bound_op_uses_bandwidth_and_ops_sum():
    add = OpRecord("aten.add", "recompute", flops=0, read_bytes=2 * 10**9, write_bytes=10**9)
    mm = OpRecord("aten.mm", "forward", flops=10**12, read_bytes=0, write_bytes=0, dtype_bytes=2)
    assert roofline_ms([add], DEV) == pytest.approx(3.0)  # 3e9 B / 1e12 B/s
    assert roofline_ms([add, mm], DEV) == pytest.approx(13.0)
    assert roofline_ms([add, mm], DEV, phases=["recompute"]) == pytest.approx(3.0)
    assert roofline_ms([], DEV) == 0.0


def test_device_by_name_and_errors():
    op = OpRecord("aten.mm", "forward", flops=989 * 10**12, read_bytes=0, write_bytes=0,
                  dtype_bytes=2)
    assert roofline_ms([op], "h100-80gb") == pytest.approx(1000.0)
    assert roofline_ms([op], DEVICES["h100-80gb"]) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="unknown phase"):
        roofline_ms([op], DEV, phases=["fwd"])
    with pytest.raises(ValueError, match="unknown device"):
        roofline_ms([op], "tpu-v9")


def test_profile_ops_carry_dtype_and_bytes(toy):
    model = toy(n=1).to(torch.bfloat16)
    prof = profile(model, torch.randn(8, 64, dtype=torch.bfloat16), timing=False)
    mm = next(op for op in prof.ops if op.name == "aten.mm")
    assert mm.dtype_bytes == 2
    assert mm.read_bytes == 8 * 64 * 2 + 64 * 64 * 2 and mm.write_bytes == 8 * 64 * 2
    assert roofline_ms(prof.ops, DEV) > roofline_ms(prof.ops, DEV, phases=["forward"]) > 0


def test_gqa_attention_flops_when_the_formula_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch < 2.13's SDPA formula asserts on grouped KV heads; op_flops widens them."""
    from torch.utils import flop_counter

    from remat.measure import flops

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    formula = flops.flop_formula(op)
    assert formula is not None
    q, k, v = torch.randn(2, 8, 16, 4), torch.randn(2, 2, 16, 4), torch.randn(2, 2, 16, 4)
    out = torch.randn(2, 8, 16, 4)
    expected = formula(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), out_val=out)
    assert expected == 2 * 2 * (2 * 8) * 16 * 16 * 4  # two bmm: q k^T and p v

    def old_formula(*args: object, out_val: object = None, **kwargs: object) -> int:
        shapes = [flop_counter.get_shape(a) for a in args[:3]]
        if shapes[0][1] != shapes[1][1]:  # the pre-2.13 check
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return int(formula(*args, out_val=out_val, **kwargs))

    monkeypatch.setitem(flops._EXTRA_FORMULAS, op, old_formula)
    monkeypatch.delitem(flop_counter.flop_registry, op, raising=False)
    monkeypatch.setattr(flops, "_FLOPS", {})  # FLOPs other tests kept by these shapes
    assert flops.op_flops(op, (q, k, v), {}, out) == expected
    with pytest.raises(AssertionError):  # not a head mismatch: the error stays
        flops.op_flops(op, (q, torch.randn(2, 3, 16, 4), v), {}, out)


def test_flops_are_kept_per_op_and_argument_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ FLOPs by shapes ]: a formula runs once per op and shapes, and its answer is
    the formula's; other shapes or values are computed again."""
    from torch.utils import flop_counter

    from remat.measure import flops

    mm, addmm = torch.ops.aten.mm, torch.ops.aten.addmm
    calls: list[object] = []

    def counted(op: object) -> object:
        formula = flop_counter.flop_registry[op]

        def count(*args: object, **kwargs: object) -> int:
            calls.append(op)
            return int(formula(*args, **kwargs))
        return count

    for op in (mm, addmm):
        monkeypatch.setitem(flops._EXTRA_FORMULAS, op, counted(op))
        monkeypatch.delitem(flop_counter.flop_registry, op)
    monkeypatch.setattr(flops, "_FLOPS", {})
    a, b = torch.ones(8, 64), torch.ones(64, 32)
    assert flops.op_flops(mm, (a, b), {}, a @ b) == 2 * 8 * 64 * 32
    assert flops.op_flops(mm, (torch.zeros(8, 64), torch.zeros(64, 32)), {},
                          torch.zeros(8, 32)) == 2 * 8 * 64 * 32
    assert calls == [mm]  # the second call, same shapes, was not computed again
    assert flops.op_flops(mm, (b.t(), a.t()), {}, b.t() @ a.t()) == 2 * 32 * 64 * 8
    bias = torch.ones(32)
    assert flops.op_flops(addmm, (bias, a, b), {}, bias + a @ b) == 2 * 8 * 64 * 32
    assert flops.op_flops(addmm, (bias, a, b), {"beta": 1}, bias + a @ b) == 2 * 8 * 64 * 32
    assert flops.op_flops(addmm, (bias, a, b), {"beta": True}, bias + a @ b) == 2 * 8 * 64 * 32
    assert calls == [mm, mm, addmm, addmm, addmm]  # a value's type is part of its key
