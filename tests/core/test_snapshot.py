"""Reading CUDA memory snapshots built here from the documented format
(``torch.cuda.memory._snapshot``'s docstring): the peak, an out-of-memory event, the fix."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

import remat
from remat.core.cost import Category
from remat.core.doctor import Cause
from remat.core.snapshot import frame_category, frame_site, load_snapshot, read_snapshot

MIB = 1 << 20
FORWARD = [{"filename": "/home/me/model.py", "line": 42, "name": "forward"},
           {"filename": "/venv/torch/nn/modules/module.py", "line": 1750, "name": "_call_impl"},
           {"filename": "/home/me/train.py", "line": 7, "name": "<module>"}]
BACKWARD = [{"filename": "??", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply"},
            {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main"}]
GRADS = [{"filename": "??", "line": 0, "name": "torch::autograd::AccumulateGrad::apply"},
         *BACKWARD]
STATE = [{"filename": "/venv/torch/optim/adamw.py", "line": 90, "name": "_init_group"},
         {"filename": "/home/me/train.py", "line": 9, "name": "<module>"}]
PARAMS = [{"filename": "/venv/torch/nn/modules/module.py", "line": 900, "name": "_apply"},
          {"filename": "/home/me/train.py", "line": 3, "name": "<module>"}]
RECOMPUTE = [*FORWARD[:2], {"filename": "/venv/torch/utils/checkpoint.py", "line": 1, "name":
                            "recompute_fn"}, *BACKWARD]


def block(address: int, size: int, state: str = "active_allocated",
          frames: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"address": address, "size": size, "requested_size": size, "state": state,
            "frames": list(frames or [])}


def segment(address: int, blocks: list[dict[str, Any]], *, stream: int = 0,
            kind: str = "large") -> dict[str, Any]:
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {"device": 0, "address": address, "total_size": sum(b["size"] for b in blocks),
            "stream": stream, "segment_type": kind, "segment_pool_id": (0, 0),
            "allocated_size": active, "active_size": active, "blocks": blocks}


def oom(size: int, device_free: int) -> dict[str, Any]:
    return {"action": "oom", "addr": 0, "size": size, "stream": 0, "device_free": device_free,
            "frames": FORWARD}


def fragmented() -> dict[str, Any]:
    """Four 20 MiB segments, each 12 MiB used and 8 MiB free; a 24 MiB request fails with
    10 MiB free on the device: 42 MiB free in all, no 24 MiB block."""
    segments = [segment(i * 100 * MIB, [block(i * 100 * MIB, 12 * MIB, frames=FORWARD),
                                        block(i * 100 * MIB + 12 * MIB, 8 * MIB, "inactive")])
                for i in range(4)]
    trace = [{"action": "alloc", "addr": i * 100 * MIB, "size": 12 * MIB, "stream": 0,
              "frames": FORWARD} for i in range(4)]
    return {"segments": segments, "device_traces": [[*trace, oom(24 * MIB, 10 * MIB)]]}


def activations_oom(activation_mib: int = 48) -> dict[str, Any]:
    """One 100 MiB segment, full but for 2 MiB; a 40 MiB request fails with 8 MiB free."""
    parts = [(20, PARAMS), (20, STATE), (10, GRADS), (activation_mib, FORWARD),
             (48 - activation_mib, PARAMS)]
    blocks, at = [], 0
    for mib, frames in parts:
        if mib:
            blocks.append(block(at, mib * MIB, frames=frames))
            at += mib * MIB
    blocks.append(block(at, 2 * MIB, "inactive"))
    return {"segments": [segment(0, blocks)], "device_traces": [[oom(40 * MIB, 8 * MIB)]]}


def test_fragmentation_oom_is_fixed_by_expandable_segments() -> None:
    d = read_snapshot(fragmented())
    assert d.traced and d.framed and not d.expandable
    event = d.out_of_memory
    assert event is not None
    m = event.moment
    assert (m.allocated_bytes, m.reserved_bytes, m.free_reserved_bytes) == \
        (48 * MIB, 80 * MIB, 32 * MIB)
    assert m.largest_free_bytes == m.largest_usable_free_bytes == 8 * MIB
    assert m.by_category == {Category.ACTIVATIONS: 48 * MIB}
    assert m.sites == (("model.py:42 forward", 48 * MIB),)
    assert (event.requested_bytes, event.available_bytes, event.short_bytes) == \
        (24 * MIB, 42 * MIB, 0)
    (finding,) = d.findings
    assert finding.cause is Cause.FRAGMENTATION and finding.severity == "error"
    assert "expandable_segments:True" in finding.fix


def test_activation_oom_is_fixed_by_a_plan() -> None:
    d = read_snapshot(activations_oom())
    event = d.out_of_memory
    assert event is not None and event.short_bytes == 30 * MIB  # 40 - (2 + 8)
    assert event.moment.by_category == {Category.ACTIVATIONS: 48 * MIB,
                                        Category.PARAMETERS: 20 * MIB,
                                        Category.OPTIMIZER_STATE: 20 * MIB,
                                        Category.GRADIENTS: 10 * MIB}
    (finding,) = d.findings
    assert finding.cause is Cause.ACTIVATIONS and finding.size_bytes == 30 * MIB
    assert "remat plan --budget device" in finding.fix


def test_oom_beyond_the_activations_needs_a_smaller_shape() -> None:
    (finding,) = read_snapshot(activations_oom(activation_mib=10)).findings
    assert finding.cause is Cause.SHAPE and finding.size_bytes == 30 * MIB
    assert "smaller batch" in finding.fix


def test_peak_is_rebuilt_from_the_trace() -> None:
    """Dump: c (2 MiB) and b (8 MiB) in a 20 MiB segment; the trace freed a (8 MiB,
    forward) after b was allocated: the peak held a and b, 16 MiB."""
    dump = segment(0, [block(0, 2 * MIB, frames=STATE), block(2 * MIB, 6 * MIB, "inactive"),
                       block(8 * MIB, 8 * MIB, frames=BACKWARD),
                       block(16 * MIB, 4 * MIB, "inactive")])
    trace = [{"action": "segment_alloc", "addr": 0, "size": 20 * MIB, "stream": 0},
             {"action": "alloc", "addr": 0, "size": 8 * MIB, "stream": 0, "frames": FORWARD},
             {"action": "alloc", "addr": 8 * MIB, "size": 8 * MIB, "stream": 0,
              "frames": BACKWARD},
             {"action": "free_requested", "addr": 0, "size": 8 * MIB, "stream": 0},
             {"action": "free_completed", "addr": 0, "size": 8 * MIB, "stream": 0,
              "frames": []},
             {"action": "alloc", "addr": 0, "size": 2 * MIB, "stream": 0, "frames": STATE},
             {"action": "snapshot", "addr": 0, "size": 0, "stream": 0}]
    d = read_snapshot({"segments": [dump], "device_traces": [trace]})
    assert d.at_dump.allocated_bytes == 10 * MIB and d.at_dump.largest_free_bytes == 6 * MIB
    assert d.peak is not None and d.out_of_memory is None and d.findings == ()
    assert d.peak.allocated_bytes == 16 * MIB and d.peak.reserved_bytes == 20 * MIB
    assert d.peak.by_category == {Category.ACTIVATIONS: 8 * MIB,  # the alloc's frames
                                  Category.BACKWARD_TEMPORARIES: 8 * MIB}
    assert d.peak.largest_free_bytes == 4 * MIB


def test_snapshot_without_trace_or_frames() -> None:
    legacy = {"size": 4 * MIB, "state": "active_allocated",
              "history": [{"real_size": 4 * MIB, "frames": PARAMS}]}
    bare = segment(0, [block(0, 2 * MIB), block(2 * MIB, 2 * MIB, "inactive")])
    d = read_snapshot({"segments": [bare, {**segment(50 * MIB, []), "blocks": [legacy],
                                           "total_size": 4 * MIB}]})
    assert not d.traced and d.peak is None and d.out_of_memory is None
    assert d.at_dump.by_category == {Category.PARAMETERS: 4 * MIB, Category.OTHER: 2 * MIB}
    assert d.at_dump.reserved_bytes == 8 * MIB and d.findings == ()


def test_large_free_share_without_oom_is_advice() -> None:
    data = {"segments": [segment(0, [block(0, 200 * MIB, frames=FORWARD),
                                     block(200 * MIB, 300 * MIB, "inactive"),
                                     block(500 * MIB, 100 * MIB, frames=FORWARD)])]}
    (finding,) = read_snapshot(data).findings
    assert finding.cause is Cause.FRAGMENTATION and finding.severity == "advice"
    assert finding.size_bytes == 300 * MIB


@pytest.mark.parametrize(("frames", "category"), [
    (FORWARD, Category.ACTIVATIONS), (BACKWARD, Category.BACKWARD_TEMPORARIES),
    (GRADS, Category.GRADIENTS), (STATE, Category.OPTIMIZER_STATE),
    (PARAMS, Category.PARAMETERS), (RECOMPUTE, Category.RECOMPUTED),
    ([{"filename": "/venv/torch/optim/adamw.py", "line": 1, "name": "_multi_tensor_adamw"}],
     Category.OPTIMIZER_TEMPORARIES),
    ([{"filename": "/venv/torch/utils/data/_utils/pin_memory.py", "line": 1,
       "name": "pin_memory"}], Category.BATCH),
    ([], Category.OTHER)])
def test_frame_categories(frames: list[dict[str, Any]], category: Category) -> None:
    assert frame_category(frames) is category


def test_frame_site_prefers_your_code() -> None:
    assert frame_site(FORWARD) == "model.py:42 forward"
    assert frame_site([]) == "(no frames)"


def test_files_are_unpickled_safely(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [Evil()]}))
    with pytest.raises(ValueError, match=r"^remat.doctor: .* is not a CUDA memory snapshot"):
        load_snapshot(path)
    assert not marker.exists()
    path.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="is not a pickle file"):
        load_snapshot(path)
    path.write_bytes(pickle.dumps({"traces": []}))
    with pytest.raises(ValueError, match="has no 'segments' list"):
        load_snapshot(path)


def test_doctor_reads_a_snapshot_file(tmp_path: Path) -> None:
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(fragmented()))
    report = remat.doctor(snapshot=path)
    assert not report.healthy and report.steps == ()
    assert report.snapshot is not None and report.snapshot.out_of_memory is not None
    assert report.to_dict()["findings"][0]["cause"] == "fragmentation"
