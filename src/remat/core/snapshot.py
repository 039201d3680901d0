"""A CUDA memory snapshot read: the peak, an out-of-memory event, and what fixes it.

``torch.cuda.memory._dump_snapshot(path)`` pickles ``torch.cuda.memory._snapshot()``: the
allocator's ``segments`` (each a ``cudaMalloc``, cut into ``blocks`` that are
``active_allocated``, ``active_pending_free`` or ``inactive``, each with the ``frames`` of
the call that allocated it) and, while ``torch.cuda.memory._record_memory_history()`` runs,
``device_traces``: one list of actions per device (``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ``segment_free``, ``oom`` with ``device_free``,
``snapshot``). The format is documented in ``torch/cuda/memory.py`` (``_snapshot``) and read
by ``torch/cuda/_memory_viz.py``. Plain dicts and lists: this module imports no torch.

NOTE [ Reading a snapshot ]
    1. Loading. The file is a pickle of built-in types only; it is read with an unpickler
       that refuses every class (a pickle can name any callable), so a file that is not a
       snapshot fails with a message, never runs code.
    2. The moment of the dump is the segments as they are: allocated bytes are the sizes of
       active blocks (``active_pending_free`` included: the memory is not reusable yet),
       reserved bytes the segments' sizes, the free blocks the gaps between active blocks in
       each segment (free neighbours merge, so the gaps are the allocator's free blocks).
    3. Earlier moments (the peak, the out-of-memory event) exist only with a trace. The
       trace ends at the dump, so the state after trace entry i is the dump's state with
       the later entries undone, walking back: an ``alloc`` removes its block, a
       ``free_completed`` puts it back (with the frames of its ``alloc`` when the trace
       holds it), a ``segment_alloc`` removes its segment, a ``segment_free`` puts it back.
       A block put back has its request rounded to 512 B, the allocator's block size for a
       split block; an unsplit block's true size is not in the trace. The peak is the entry
       after which allocated bytes are highest (the dump included).
    4. Categories come from the frames of the call that allocated a block
       (:func:`frame_category`): the autograd engine or a ``backward`` frame is backward
       (``AccumulateGrad``: gradients; ``torch/utils/checkpoint.py`` within it:
       recomputation), ``torch/optim`` is the optimizer (its ``_init_group``: the state),
       a module's ``_apply`` / ``load_state_dict`` / ``__init__`` the parameters, a
       ``forward`` the activations. Without frames (history off when it was allocated, or a
       backward on CUDA's own thread recorded with Python stacks only) a block is
       ``other``: the frames do not say.
    5. An out-of-memory event (the trace's last ``oom``) failed on a request of ``size``
       bytes with ``device_free`` bytes left on the device. At that moment the allocator
       held ``reserved - allocated`` bytes in free blocks; it had released what it could
       (whole free segments) before failing. The request would have fit in the free bytes
       (``free reserved + device_free``) but not in the largest free block of its pool
       (small: up to 1 MiB; large) and stream: fragmentation, which expandable segments fix
       (a segment grows page by page, and free pages return to the device). Otherwise the
       step needs ``request - free`` more bytes than the card has: a plan fixes it when the
       activations are at least that (checkpointing removes activations), else a smaller
       batch or sequence.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.core.cost import Category
from remat.core.doctor import ADVICE, ERROR, Cause, Finding
from remat.errors import message

_API = "remat.doctor"
_SMALL_BYTES = 1 << 20  # the small pool's largest block (kSmallSize)
_BLOCK_BYTES = 512  # kMinBlockSize: every block is a multiple of it
#: A snapshot without an out-of-memory event gets the expandable-segments advice when at
#: least this share of what it reserves is free blocks (and at least _MIN_FREE_BYTES).
FRAGMENTED_SHARE = 0.25
_MIN_FREE_BYTES = 256 << 20
_ACTIVE = ("active_allocated", "active_pending_free")
#: Classes a snapshot pickle may name (built-in containers only; NOTE [ Reading a snapshot ]).
_ALLOWED = frozenset({"set", "frozenset", "bytearray", "complex", "slice", "range"})

Frames = Sequence[Mapping[str, Any]]


class _Refused(pickle.UnpicklingError):
    """A pickle named a class a snapshot has no use for."""


class _SnapshotUnpickler(pickle.Unpickler):
    """Unpickles built-in types only (NOTE [ Reading a snapshot ], 1.)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _ALLOWED:
            return getattr(builtins, name)
        raise _Refused(f"{module}.{name}")


def load_snapshot(source: str | os.PathLike[str] | bytes | Mapping[str, Any]) -> dict[str, Any]:
    """A snapshot from its pickle file (or bytes), read safely; a dict is returned as is.

    Args:
        source: the path of a ``torch.cuda.memory._dump_snapshot`` file, its bytes, or the
            dict ``torch.cuda.memory._snapshot()`` returned.

    Raises:
        ValueError: the file is not a pickle of a snapshot (or names a class: refused).
        FileNotFoundError: no such file.

    Example:
        >>> load_snapshot({"segments": [], "device_traces": []})["segments"]
        []
    """
    if isinstance(source, Mapping):
        data: Any = dict(source)
    else:
        raw = source if isinstance(source, bytes) else Path(source).read_bytes()
        where = "the bytes given" if isinstance(source, bytes) else str(source)
        try:
            data = _SnapshotUnpickler(io.BytesIO(raw)).load()
        except _Refused as exc:
            raise ValueError(message(
                _API, f"{where} is not a CUDA memory snapshot",
                {"pickle refers to": str(exc),
                 "why": "a snapshot is a pickle of dicts and lists; other classes are "
                        "refused, since unpickling them could run code"},
                fix="pass a file written by torch.cuda.memory._dump_snapshot(path)")) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
                AttributeError) as exc:
            raise ValueError(message(_API, f"{where} is not a pickle file",
                                     {"error": f"{type(exc).__name__}: {exc}"},
                                     fix="pass a file written by "
                                         "torch.cuda.memory._dump_snapshot(path)")) from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise ValueError(message(_API, "the snapshot has no 'segments' list",
                                 {"found": type(data).__name__ if not isinstance(data, dict)
                                  else f"keys {sorted(map(str, data))[:6]}"},
                                 fix="pass a file written by "
                                     "torch.cuda.memory._dump_snapshot(path)"))
    return data


# ---- categories from frames (NOTE [ Reading a snapshot ], 4.) ----------------------------

def _is_backward(filename: str, name: str) -> bool:
    return ("autograd::Engine" in name or "Backward" in name or "run_backward" in name
            or name == "backward" or "torch/autograd/" in filename and "backward" in name)


_PARAM_CALLS = frozenset({"_apply", "to", "cuda", "to_empty", "load_state_dict",
                          "_load_from_state_dict", "register_parameter", "register_buffer"})


def frame_category(frames: Frames) -> Category:
    """The :class:`Category` of a block from the frames of the call that allocated it;
    ``Category.OTHER`` when the frames do not say (NOTE [ Reading a snapshot ], 4.).

    Example:
        >>> frame_category([{"filename": "torch/optim/adamw.py", "name": "_init_group",
        ...                  "line": 1}])
        <Category.OPTIMIZER_STATE: 'optimizer_state'>
    """
    pairs = [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", "")))
             for f in frames]
    backward = any(_is_backward(fn, nm) for fn, nm in pairs)
    if backward and any(fn.endswith("torch/utils/checkpoint.py") for fn, _ in pairs):
        return Category.RECOMPUTED
    if any("AccumulateGrad" in nm or "accumulateGrad" in nm for _, nm in pairs):
        return Category.GRADIENTS
    if backward:
        return Category.BACKWARD_TEMPORARIES
    optim = [nm for fn, nm in pairs if "torch/optim/" in fn]
    if optim:
        return Category.OPTIMIZER_STATE if "_init_group" in optim \
            else Category.OPTIMIZER_TEMPORARIES
    if any(fn.endswith("torch/nn/modules/module.py") and nm in _PARAM_CALLS
           or "torch/nn/" in fn and nm in ("__init__", "reset_parameters")
           or fn.endswith(("torch/nn/parameter.py", "torch/serialization.py"))
           or nm == "from_pretrained" for fn, nm in pairs):
        return Category.PARAMETERS
    if any("torch/utils/data/" in fn or nm == "pin_memory" for fn, nm in pairs):
        return Category.BATCH
    if any(fn.endswith("torch/nn/modules/module.py") and nm in ("_call_impl",
                                                                 "_wrapped_call_impl")
           or nm == "forward" for fn, nm in pairs):
        return Category.ACTIVATIONS
    return Category.OTHER


def frame_site(frames: Frames) -> str:
    """Where a block was allocated, for people: the innermost frame in your code (outside
    torch and site-packages), else the innermost Python frame; ``"(no frames)"``."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    own = [f for f in python if "/torch/" not in str(f["filename"]).replace("\\", "/")
           and "site-packages" not in str(f["filename"])]
    for f in own or python:
        return f"{Path(str(f['filename'])).name}:{f.get('line', '?')} {f.get('name', '')}"
    return "(no frames)" if not frames else str(frames[0].get("name", "?"))[:60]


# ---- the allocator's state at one moment ---------------------------------------------------

@dataclass(frozen=True)
class SnapshotMoment:
    """The allocator at one moment of a snapshot: what it allocated, reserved and held free.

    Args:
        allocated_bytes: bytes in active blocks (block sizes, 512 B rounding included).
        reserved_bytes: bytes in segments.
        largest_free_bytes: the largest free block (a gap between active blocks).
        by_category: allocated bytes by :class:`Category` (``other``: frames do not say).
        sites: the allocation sites holding the most bytes, ``(site, bytes)``, largest
            first (at most five).
        largest_usable_free_bytes: the largest free block of the failed request's pool and
            stream (an out-of-memory moment), else the largest free block.

    Example:
        >>> m = SnapshotMoment(6 << 20, 20 << 20, 14 << 20, {Category.ACTIVATIONS: 6 << 20})
        >>> m.free_reserved_bytes >> 20
        14
    """

    allocated_bytes: int
    reserved_bytes: int
    largest_free_bytes: int
    by_category: Mapping[Category, int] = field(default_factory=dict, hash=False)
    sites: tuple[tuple[str, int], ...] = ()
    largest_usable_free_bytes: int | None = None

    @property
    def free_reserved_bytes(self) -> int:
        """Reserved but not allocated: the free blocks' bytes."""
        return self.reserved_bytes - self.allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {"allocated_bytes": self.allocated_bytes, "reserved_bytes": self.reserved_bytes,
                "free_reserved_bytes": self.free_reserved_bytes,
                "largest_free_bytes": self.largest_free_bytes,
                "largest_usable_free_bytes": self.largest_usable_free_bytes,
                "by_category": {c.value: v for c, v in self.by_category.items()},
                "sites": [list(s) for s in self.sites]}


@dataclass(frozen=True)
class OutOfMemoryEvent:
    """The request a snapshot's trace says failed, and the allocator when it failed.

    Args:
        requested_bytes: the bytes asked for.
        device_free_bytes: what CUDA reported free on the device then.
        stream: the request's stream.
        moment: the allocator when it failed (NOTE [ Reading a snapshot ], 3.).
    """

    requested_bytes: int
    device_free_bytes: int
    stream: int
    moment: SnapshotMoment

    @property
    def available_bytes(self) -> int:
        """Free blocks plus the device's free memory: what the request could have had."""
        return self.moment.free_reserved_bytes + self.device_free_bytes

    @property
    def short_bytes(self) -> int:
        """How much more the request needed than was free in all (0: it was fragmentation)."""
        return max(self.requested_bytes - self.available_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {"requested_bytes": self.requested_bytes,
                "device_free_bytes": self.device_free_bytes, "stream": self.stream,
                "short_bytes": self.short_bytes, "moment": self.moment.to_dict()}


@dataclass(frozen=True)
class SnapshotDiagnosis:
    """A CUDA memory snapshot explained (:func:`read_snapshot`).

    Args:
        device: the device read.
        traced: the snapshot has a trace (``_record_memory_history`` was on).
        framed: its blocks carry the frames that allocated them.
        expandable: its segments are expandable (``expandable_segments:True`` was on).
        at_dump: the allocator when the snapshot was taken.
        peak: the allocator at its allocated peak within the trace, or None.
        out_of_memory: the last out-of-memory event of the trace, or None.
        findings: the diagnosis, errors first.
    """

    device: int
    traced: bool
    framed: bool
    expandable: bool
    at_dump: SnapshotMoment
    peak: SnapshotMoment | None = None
    out_of_memory: OutOfMemoryEvent | None = None
    findings: tuple[Finding, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {"device": self.device, "traced": self.traced, "framed": self.framed,
                "expandable": self.expandable, "at_dump": self.at_dump.to_dict(),
                "peak": self.peak.to_dict() if self.peak is not None else None,
                "out_of_memory": self.out_of_memory.to_dict()
                if self.out_of_memory is not None else None,
                "findings": [f.to_dict() for f in self.findings]}


# ---- state reconstruction (NOTE [ Reading a snapshot ], 2. and 3.) ------------------------

#: An active block: (bytes, frames).
_Block = tuple[int, Frames]
#: A segment: (bytes, stream, small pool).
_Segment = tuple[int, int, bool]


class _State:
    """Active blocks and segments by address, walked back from the dump."""

    def __init__(self, segments: list[Mapping[str, Any]]) -> None:
        self.blocks: dict[int, _Block] = {}
        self.segments: dict[int, _Segment] = {}
        for seg in segments:
            base = int(seg.get("address", 0))
            size = int(seg.get("total_size", 0))
            self.segments[base] = (size, int(seg.get("stream", 0)),
                                   seg.get("segment_type") == "small" or size <= 2 * _SMALL_BYTES
                                   and seg.get("segment_type") is None)
            offset = base
            for block in seg.get("blocks", []):
                nbytes = int(block.get("size", 0))
                address = int(block.get("address", offset))
                if block.get("state") in _ACTIVE:
                    self.blocks[address] = (nbytes, _frames_of(block))
                offset = address + nbytes
        self.allocated = sum(size for size, _ in self.blocks.values())

    def undo(self, entry: Mapping[str, Any], frames: Frames) -> None:
        action, address = entry.get("action"), int(entry.get("addr", -1))
        size = int(entry.get("size", 0))
        if action in ("alloc", "free_completed"):
            old = self.blocks.pop(address, None)
            if old is not None:
                self.allocated -= old[0]
        if action == "free_completed":
            rounded = max(-(-size // _BLOCK_BYTES) * _BLOCK_BYTES, _BLOCK_BYTES)
            self.blocks[address] = (rounded, frames)
            self.allocated += rounded
        elif action == "segment_alloc":
            self.segments.pop(address, None)
        elif action == "segment_free":
            self.segments[address] = (size, int(entry.get("stream", 0)), size <= 2 * _SMALL_BYTES)

    def free_blocks(self, pool: tuple[bool, int] | None = None) -> list[int]:
        """The gaps between active blocks in each segment (of ``(small, stream)`` only)."""
        starts = sorted(self.blocks)
        gaps: list[int] = []
        for base, (size, stream, small) in self.segments.items():
            if pool is not None and (small, stream) != pool:
                continue
            at, end = base, base + size
            lo = _bisect(starts, base)
            for address in starts[lo:]:
                if address >= end:
                    break
                if address > at:
                    gaps.append(address - at)
                at = max(at, address + self.blocks[address][0])
            if end > at:
                gaps.append(end - at)
        return gaps

    def moment(self, pool: tuple[bool, int] | None = None) -> SnapshotMoment:
        by_category: dict[Category, int] = {}
        sites: dict[str, int] = {}
        for size, frames in self.blocks.values():
            category = frame_category(frames)
            by_category[category] = by_category.get(category, 0) + size
            site = frame_site(frames)
            sites[site] = sites.get(site, 0) + size
        gaps = self.free_blocks()
        usable = self.free_blocks(pool) if pool is not None else gaps
        top = tuple(sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
        return SnapshotMoment(self.allocated, sum(s for s, _, _ in self.segments.values()),
                              max(gaps, default=0), dict(sorted(by_category.items(),
                                                                key=lambda kv: -kv[1])),
                              top, max(usable, default=0))


def _bisect(values: list[int], x: int) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _frames_of(block: Mapping[str, Any]) -> Frames:
    frames = block.get("frames")
    if frames is None and block.get("history"):  # the format before torch 2.1
        frames = block["history"][0].get("frames", [])
    return list(frames or [])


def _changes(entry: Mapping[str, Any]) -> bool:
    return entry.get("action") in ("alloc", "free_completed", "segment_alloc", "segment_free")


def read_snapshot(source: str | os.PathLike[str] | bytes | Mapping[str, Any], *,
                  device: int | None = None) -> SnapshotDiagnosis:
    """Explain a CUDA memory snapshot: the peak, an out-of-memory event, and the fix.

    Reads what a snapshot can say (NOTE [ Reading a snapshot ]): the allocated bytes by
    category where the frames say so, the reserved bytes that are free blocks
    (fragmentation), the largest free block against a failed request, and whether a plan
    (the activations cover what is missing), a smaller shape, or
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the request fits in the free bytes,
    not in one free block) fixes it. Without a trace only the moment of the dump is known.

    Args:
        source: a snapshot file, its bytes, or the dict (see :func:`load_snapshot`).
        device: the device to read. Default: the one with an out-of-memory event, else the
            one that reserves the most.

    Returns:
        A :class:`SnapshotDiagnosis`.

    Example:
        >>> d = read_snapshot({"segments": [], "device_traces": []})
        >>> d.at_dump.reserved_bytes, d.findings
        (0, ())
    """
    data = load_snapshot(source)
    traces = data.get("device_traces") or []
    segments = [s for s in data["segments"] if isinstance(s, Mapping)]
    if device is None:
        device = _default_device(segments, traces)
    segments = [s for s in segments if int(s.get("device", device)) == device]
    trace = [e for e in ((traces[device] or []) if 0 <= device < len(traces) else [])
             if isinstance(e, Mapping)]
    framed = any(_frames_of(b) for s in segments for b in s.get("blocks", []))
    expandable = any(s.get("is_expandable") for s in segments)
    # the frames of each free's alloc, for blocks put back (NOTE [ Reading a snapshot ], 3.)
    alloc_frames: dict[int, Frames] = {}
    free_frames: dict[int, Frames] = {}
    for i, entry in enumerate(trace):
        if entry.get("action") == "alloc":
            alloc_frames[int(entry.get("addr", -1))] = list(entry.get("frames") or [])
        elif entry.get("action") == "free_completed":
            free_frames[i] = alloc_frames.get(int(entry.get("addr", -1)),
                                              list(entry.get("frames") or []))
    state = _State(segments)
    at_dump = state.moment()
    peak_index, oom_index = _walk(state, trace, free_frames)
    peak = oom = None
    if trace:
        peak = _state_after(segments, trace, free_frames, peak_index).moment() \
            if peak_index is not None else at_dump
    if oom_index is not None:
        entry = trace[oom_index]
        requested = int(entry.get("size", 0))
        stream = int(entry.get("stream", 0))
        pool = (requested <= _SMALL_BYTES, stream)
        oom = OutOfMemoryEvent(requested, int(entry.get("device_free", 0)), stream,
                               _state_after(segments, trace, free_frames, oom_index).moment(pool))
    return SnapshotDiagnosis(device, bool(trace), framed, expandable, at_dump, peak, oom,
                             _findings(at_dump, peak, oom, expandable))


def _default_device(segments: list[Mapping[str, Any]], traces: list[Any]) -> int:
    for d, trace in enumerate(traces):
        if any(isinstance(e, Mapping) and e.get("action") == "oom" for e in trace or []):
            return d
    reserved: dict[int, int] = {}
    for s in segments:
        d = int(s.get("device", 0))
        reserved[d] = reserved.get(d, 0) + int(s.get("total_size", 0))
    return max(reserved, key=lambda d: reserved[d]) if reserved else 0


def _walk(state: _State, trace: list[Mapping[str, Any]], free_frames: dict[int, Frames]
          ) -> tuple[int | None, int | None]:
    """Walk back from the dump: the entry after which allocated bytes peak (None: the dump
    itself; -1: before the trace's first entry) and the last out-of-memory entry. ``state``
    is used up."""
    best, best_index = state.allocated, None
    oom_index = None
    for i in range(len(trace) - 1, -1, -1):
        entry = trace[i]
        if oom_index is None and entry.get("action") == "oom":
            oom_index = i
        if not _changes(entry):
            continue
        state.undo(entry, free_frames.get(i, ()))
        allocated = state.allocated  # the state after entry i - 1 (-1: before the trace)
        if allocated > best:
            best, best_index = allocated, i - 1
    return best_index, oom_index


def _state_after(segments: list[Mapping[str, Any]], trace: list[Mapping[str, Any]],
                 free_frames: dict[int, Frames], index: int) -> _State:
    state = _State(segments)
    for i in range(len(trace) - 1, index, -1):
        if _changes(trace[i]):
            state.undo(trace[i], free_frames.get(i, ()))
    return state


# ---- the diagnosis (NOTE [ Reading a snapshot ], 5.) ---------------------------------------

_EXPANDABLE_FIX = ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the job "
                   "starts (segments then grow page by page and free pages go back to the "
                   "device)")
_PLAN_FIX = ("plan activation checkpointing for the card: remat plan --budget device (or "
             "remat.plan(model, batch, budget='device'))")
_SHAPE_FIX = ("use a smaller batch or shorter sequences (remat plan --maximize seq-len finds "
              "the longest that fits), or hold fewer static bytes (a lower-precision "
              "optimizer state, FSDP)")


def _findings(at_dump: SnapshotMoment, peak: SnapshotMoment | None,
              oom: OutOfMemoryEvent | None, expandable: bool) -> tuple[Finding, ...]:
    if oom is None:
        moment = peak or at_dump
        free = moment.free_reserved_bytes
        if not expandable and free >= _MIN_FREE_BYTES and \
                free >= FRAGMENTED_SHARE * moment.reserved_bytes:
            return (Finding(Cause.FRAGMENTATION, ADVICE, "", free, 0, None,
                            "a large share of what the allocator reserves is free blocks "
                            "it could not reuse", _EXPANDABLE_FIX),)
        return ()
    moment = oom.moment
    usable = moment.largest_usable_free_bytes or 0
    activations = sum(moment.by_category.get(c, 0) for c in (Category.ACTIVATIONS,
                                                             Category.RECOMPUTED))
    top_site = moment.sites[0][0] if moment.sites else ""
    if oom.short_bytes == 0 and oom.requested_bytes > usable:
        detail = ("the failed request is smaller than the free bytes the allocator held "
                  "(free blocks and the device's free memory) but larger than its largest "
                  "free block")
        if expandable:
            return (Finding(Cause.FRAGMENTATION, ERROR, top_site, oom.requested_bytes, 0,
                            None, detail + "; expandable segments are already on",
                            "free large tensors earlier, or plan activation checkpointing "
                            "so the step allocates less: remat plan --budget device"),)
        return (Finding(Cause.FRAGMENTATION, ERROR, top_site, oom.requested_bytes, 0, None,
                        detail, _EXPANDABLE_FIX),)
    short = oom.short_bytes
    if activations >= short and activations > 0:
        return (Finding(Cause.ACTIVATIONS, ERROR, top_site, short, 0, None,
                        "the step needs more than the card holds, and the activations "
                        "alive when it failed are more than what is missing", _PLAN_FIX),)
    unknown = moment.by_category.get(Category.OTHER, 0)
    detail = "the step needs more than the card holds, more than its activations"
    if unknown >= short:
        detail += (" as far as the frames say (record the history with stacks='all' to "
                   "tell activations apart; if the unattributed bytes are activations, "
                   "a plan fixes it)")
    return (Finding(Cause.SHAPE, ERROR, top_site, short, 0, None, detail, _SHAPE_FIX),)
