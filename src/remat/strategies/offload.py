"""Offload a region's saved tensors to pinned host memory, the copies on a side stream.

NOTE [ Asynchronous offload ]
    ``torch.autograd.graph.save_on_cpu`` copies each saved tensor with a blocking
    ``copy_`` on the compute stream when it is packed: no copy is hidden behind compute,
    and each tensor costs a host sync (``benchmarks/gpu.py`` measures it). It
    also copies weights (saved by every matmul, alive anyway) and copies a tensor once
    per op that saves it (a norm's output saved by q, k and v: three copies, three
    device copies back in backward). :func:`offloading` does this instead, per call of
    the region:

    1. **pack** (forward): a saved tensor of the region's own parameters or buffers (or
       a view of one) is kept as it is; any other is copied to pinned host memory on a
       side stream, after the compute stream's work so far. The device tensor is held
       until the region's forward ends. A tensor saved by several ops is copied once.
    2. **region end**: the host waits for the region's copies, then drops the device
       tensors. The bytes leave the device when the region's forward ends rather than
       as each tensor is packed, so a block's forward peak is its un-offloaded one; the
       copies overlap the region's own kernels.
    3. **first unpack** (backward): every tensor of the region is copied back on the
       side stream and the compute stream waits for them: these copies are not hidden.
       The region drops its reference to each device copy after that tensor's last
       unpack; autograd's own references free it as usual. A second backward through a
       retained graph copies again from the host.

    On fake tensors (the planner's measurements) and other devices' tensors the same
    steps run without streams, so the tracker sees the bytes the real run holds.

    Measured (``benchmarks/gpu.py`` on an H100, llama-1b, batch 4, seq 4096, every block
    offloaded; benchmarks/gpu_h100_save_on_cpu.json and gpu_h100.json): the step went
    from 1882 ms (``save_on_cpu``) to 1570 ms against 376 ms for ``none``; the peak the
    allocator measured (30.70 GiB) is the simulated one plus the same 64 MiB every
    strategy shows. Copies back are not prefetched: the blocks' copies (1242 ms at the
    link measured in that run) exceed the whole step's kernels, so prefetching could
    hide at most the backward's share while holding a second block's tensors.

NOTE [ Offloaded checkpoints ]
    ``full_offload`` checkpoints a block as ``full`` does and keeps what the checkpoint
    saves (the block's inputs) on the host: one hidden state per block, small enough for
    the copies to hide behind the blocks' kernels. :func:`offloading_inputs` wraps the
    checkpoint call in the packing hooks above; the checkpoint's own hooks replace them
    inside the block, so only the inputs it saves reach them. Per call of the region:

    Rule 1. Only activations are copied: a saved tensor with a ``grad_fn`` (the hidden
       state an earlier block or the embedding produced). Masks and rotary tables
       (shared by every block, alive in the caller anyway), a batch the user holds and
       the region's parameters stay as they are: copying them frees no device memory.
    Rule 2. Out: each copy is queued on the side stream after the compute stream's work
       so far (so after the input was produced) and overlaps the block's forward. At the
       region's end the *compute stream* waits for the copies (an event; the host does
       not block) and the region drops the device tensor: its memory can only be reused
       by kernels queued after the copy. A block much shorter than its copy stalls
       there, at its own end rather than at the next block's.
    Rule 3. Back: when block i's backward first needs its inputs (its recompute
       starts), their copy back is waited for, and block i-1's copy back (the region
       that ran just before, in forward order) starts on the side stream: it overlaps
       block i's recompute and backward, and block i-1's recompute waits for it on an
       event. Two blocks' inputs are on the device at once. The first block backward
       reaches (the last one run) waits for its copy back: one hidden state a step,
       not hidden. A region freed with its copies back never waited for (a backward
       that stopped before it) makes the compute stream wait for them first, so their
       memory is not reused while the side stream still writes it.
    Rule 4. The regions are chained by weak references: a region that was freed (its
       graph released) is skipped, and a region whose inputs are already back is not
       copied again. Several forwards before one backward only prefetch early.

    On fake tensors and without CUDA the same steps run synchronously, so the tracker
    sees the device bytes the real run holds: each block's input freed at the block's
    end, block i-1's input back while block i recomputes. The host copies live on
    :data:`HOST`, which a device's tracker does not count. A block running on the host
    itself (the CPU) has nothing to gain: it runs as ``full`` (:func:`offloads_from`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

_STREAMS: dict[int, Any] = {}
#: Where host copies live. A device's tracker leaves its storages out (NOTE [ Offloaded
#: checkpoints ]).
HOST = torch.device("cpu")
#: NOTE [ Simulated host ]: non-empty while fake steps stand for a device with a host.
_SIMULATED_HOST: list[bool] = []


@contextlib.contextmanager
def simulated_host() -> Iterator[None]:
    """Run fake steps as on a device with its own host memory (a GPU), though the fake
    tensors say ``cpu``.

    NOTE [ Simulated host ]
        ``remat simulate`` runs a GPU's step on fake CPU tensors (the device spec
        prices it). There the CPU is the device, not the host: ``offload`` and
        ``full_offload`` must move what they move, and the copies must leave the
        device's count. Inside this context :func:`offloads_from` says yes for any
        device but meta, and host copies are made on the meta device, which the
        tracker of the (fake) CPU does not count. Fake steps only: a real CPU tensor
        copied to meta loses its values.

    Example:
        >>> with simulated_host():
        ...     prof = remat.profile(model, batch, simulate=True)
    """
    _SIMULATED_HOST.append(True)
    try:
        yield
    finally:
        _SIMULATED_HOST.pop()


def host_simulated() -> bool:
    """Whether fake steps run as on a device with a host (:func:`simulated_host`)."""
    return bool(_SIMULATED_HOST)


def host_device() -> torch.device:
    """Where host copies go: :data:`HOST`, or meta under :func:`simulated_host`."""
    return torch.device("meta") if _SIMULATED_HOST else HOST


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


def _storage(t: torch.Tensor) -> StorageWeakRef | None:
    """A key for ``t``'s storage; None for tensor subclasses that have none (DTensor)."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass
class _Region:
    """One call of an offloaded region: its copies out, then its copies back."""

    device: torch.device
    asynchronous: bool
    kept: set[StorageWeakRef]  # the storages of the region's parameters and buffers
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> device tensor
    host: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> host copy
    uses: dict[int, int] = field(default_factory=dict)  # id -> packs not yet unpacked
    back: dict[int, torch.Tensor] | None = None  # id -> device copy, after the first unpack

    def pack(self, t: torch.Tensor) -> Any:
        if self._keep(t):
            return t
        key = id(t)
        if key not in self.held:
            self.held[key] = t
            self.host[key] = self._copy_out(t)
        self.uses[key] = self.uses.get(key, 0) + 1
        return _Packed(self, key)

    def _keep(self, t: torch.Tensor) -> bool:
        if t.device.type != self.device.type or isinstance(t, nn.Parameter):
            return True
        ref = _storage(t)
        return ref is None or ref in self.kept  # a subclass without storage stays

    @torch.no_grad()
    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        if not self.asynchronous:
            return t.to(host_device(), copy=True)  # a copy even on the host itself
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        return host

    def close(self) -> None:
        """Region end: wait for the copies out, then let the device tensors go."""
        if self.asynchronous and self.held:
            _side_stream(self.device).record_event().synchronize()
        self.held.clear()

    def unpack(self, key: int) -> torch.Tensor:
        if self.back is None:
            self.back = self._copy_back()
        tensor = self.back.get(key)
        if tensor is None:  # a second backward through a retained graph
            with torch.no_grad():
                return self.host[key].to(self.device)
        self.uses[key] -= 1
        if self.uses[key] == 0:
            del self.back[key]
        return tensor

    def _copy_back(self) -> dict[int, torch.Tensor]:
        back, ready = self._start_back()
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return back

    @torch.no_grad()
    def _start_back(self) -> tuple[dict[int, torch.Tensor], Any]:
        """Queue the copies back; return them and the side stream's event after them
        (None when they ran synchronously)."""
        if not self.asynchronous:
            return {k: h.to(self.device) for k, h in self.host.items()}, None
        compute = torch.cuda.current_stream(self.device)
        stream = _side_stream(self.device)
        back = {k: torch.empty(h.size(), dtype=h.dtype, device=self.device)
                for k, h in self.host.items()}
        stream.wait_stream(compute)  # the empty tensors' memory may be reused memory
        with torch.cuda.stream(stream):
            for k, h in self.host.items():
                back[k].copy_(h, non_blocking=True)
        return back, stream.record_event()


@dataclass(frozen=True)
class _Packed:
    region: _Region
    key: int


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Packed):
        return packed.region.unpack(packed.key)
    return packed  # type: ignore[no-any-return]


@contextlib.contextmanager
def offloading(module: nn.Module, device: torch.device, *, fake: bool) -> Iterator[None]:
    """Run a region's forward with its saved tensors offloaded (NOTE [ Asynchronous offload ]).

    The trade-off: the region's saved activations leave device memory when its forward
    ends, for a copy each way over the host link (out: overlapped with the region's
    kernels; back: not hidden).

    Args:
        module: the region's module; its parameters and buffers are never copied.
        device: the device the region runs on.
        fake: the region runs on fake tensors (no streams, no pinned memory).

    Example:
        >>> with offloading(block, torch.device("cuda"), fake=False):
        ...     out = block(x)
    """
    asynchronous = not fake and device.type == "cuda"
    kept = {ref for t in (*module.parameters(), *module.buffers())
            if (ref := _storage(t)) is not None}
    region = _Region(device, asynchronous, kept)
    try:
        with torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack):
            yield
    finally:
        region.close()


# ---- offloaded checkpoints ---------------------------------------------------------------

_LAST: dict[torch.device, weakref.ref[_InputRegion]] = {}  # device -> the newest region


@dataclass
class _InputRegion(_Region):
    """One call of a checkpointed region whose inputs live on the host (NOTE [ Offloaded
    checkpoints ])."""

    previous: weakref.ref[_InputRegion] | None = None  # the region run before, Rule 3
    ready: Any = None  # the side stream's event after this region's copies back
    guard: Any = None  # waits for ``ready`` if the region dies without unpacking, Rule 3

    def _keep(self, t: torch.Tensor) -> bool:
        return t.grad_fn is None or super()._keep(t)  # Rule 1

    def close(self) -> None:
        """Region end (Rule 2): the compute stream waits for the copies out; the device
        tensors go."""
        if self.asynchronous and self.held:
            torch.cuda.current_stream(self.device).wait_event(
                _side_stream(self.device).record_event())
        self.held.clear()

    def prefetch(self) -> None:
        """Start the copies back unless they started already (Rule 4)."""
        if self.back is None and self.host:
            self.back, self.ready = self._start_back()
            if self.ready is not None:
                self.guard = weakref.finalize(self, _wait_for, self.device, self.ready)
                self.guard.atexit = False

    def unpack(self, key: int) -> torch.Tensor:
        self.prefetch()
        if self.ready is not None:  # Rule 3: wait for this region's own copies
            _wait_for(self.device, self.ready)
            self.ready = None
            self.guard.detach()
        previous = self.previous() if self.previous is not None else None
        if previous is not None:  # Rule 3: one block ahead
            previous.prefetch()
        return super().unpack(key)


def _wait_for(device: torch.device, event: Any) -> None:
    torch.cuda.current_stream(device).wait_event(event)


def offloads_from(device: torch.device) -> bool:
    """Whether a region running on ``device`` has a host to offload to (not on the host
    itself, not on the meta device)."""
    if _SIMULATED_HOST:  # NOTE [ Simulated host ]
        return device.type != "meta"
    return device.type not in (HOST.type, "meta")


@contextlib.contextmanager
def offloading_inputs(module: nn.Module, device: torch.device, *,
                      fake: bool) -> Iterator[None]:
    """Run a checkpoint call with the inputs it saves kept on the host (NOTE [ Offloaded
    checkpoints ]).

    The trade-off against ``full``: one hidden state per block leaves the device, for a
    copy each way over the host link that overlaps the block's forward (out) and the
    next block's backward (back, prefetched).

    Args:
        module: the region's module; its parameters and buffers are never copied.
        device: the device the region runs on.
        fake: the region runs on fake tensors (no streams, no pinned memory).

    Example:
        >>> with offloading_inputs(block, torch.device("cuda"), fake=False):
        ...     out = checkpoint(block, x, use_reentrant=False)
    """
    asynchronous = not fake and device.type == "cuda"
    kept = {ref for t in (*module.parameters(), *module.buffers())
            if (ref := _storage(t)) is not None}
    region = _InputRegion(device, asynchronous, kept, previous=_LAST.get(device))
    _LAST[device] = weakref.ref(region)
    try:
        with torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack):
            yield
    finally:
        region.close()
