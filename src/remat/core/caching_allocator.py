"""A model of PyTorch's CUDA caching allocator: what a sequence of allocations reserves.

A job runs out of memory on *reserved* bytes (the segments the allocator holds), not on
allocated bytes: freed blocks stay cached in their segments, split blocks leave holes, and
a segment goes back to the device only when all of it is free. :class:`CachingAllocatorModel`
replays ``malloc`` / ``free`` calls with the rules of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``), so a step recorded on CPU or on fake tensors (a 70B model
simulated on a laptop) gives the reserved bytes it would need on the GPU.

NOTE [ CUDA caching allocator model ]
    Read from ``DeviceCachingAllocator`` in ``c10/cuda/CUDACachingAllocator.cpp``, with the
    sizes and options of torch 2.13's ``c10/core/AllocatorConfig.{h,cpp}``
    (``large_segment_size`` and ``max_non_split_rounding_size`` where older releases had
    ``kLargeBuffer``); each rule names the code it follows.

    Rule 1. Sizes. A request of ``n`` bytes needs a block of ``round_size(n)``: at least
    512 B (``kMinBlockSize``), a multiple of 512, or a power-of-two division
    (``roundup_power2_divisions``). Blocks up to 1 MiB (``kSmallSize``) come from the small
    pool, larger ones from the large pool (``get_pool``). A new segment (``alloc_block``,
    ``cudaMalloc``) is ``get_allocation_size(block)``: 2 MiB (``kSmallBuffer``) for the small
    pool, ``large_segment_size`` (20 MiB, ``kLargeBuffer``) below 10 MiB (``kMinLargeAlloc``),
    else the block rounded up to 2 MiB (``kRoundLarge``).

    Rule 2. Reuse is best fit, per pool and per stream (``get_free_block``): the smallest
    cached free block of the request's pool *and stream* at least as large as the block
    (``lower_bound`` on a set ordered by stream, size, address; ties go to the lowest
    address). A block freed on a stream serves only that stream's requests, so a side
    stream (an offload's prefetch) builds segments of its own.

    Rule 3. Oversize blocks (``max_split_size_mb``, ``get_free_block``): a request below
    ``max_split_size`` never takes a cached block at or above it; a request at or above it
    takes one only if the block is smaller than the request plus
    ``max_non_split_rounding_size`` (20 MiB unless set).

    Rule 4. Splitting (``should_split``, ``alloc_found_block``). The rest of the chosen block
    becomes a free block of its own when it is >= 512 B in the small pool (or with
    expandable segments), and in the large pool when the request is below
    ``max_split_size`` and the rest is > 1 MiB. Otherwise the whole block is handed out
    and counts as allocated: allocated bytes are block sizes, never the bytes requested.

    Rule 5. Merging (``free_block``, ``try_merge_blocks``): a freed block merges with the
    free blocks beside it in its segment. Reserved bytes never drop on their own: a
    segment goes back to the device only when it is one free block and
    ``release_cached_blocks`` runs (``empty_cache()``, or Rule 6).

    Rule 6. Out of memory (``malloc``). With no cached block that fits, a new segment is
    opened unless it would pass the capacity. Then, in order: garbage collection (Rule 8);
    ``release_available_cached_blocks`` (only with ``max_split_size``: the stream's
    smallest cached oversize block large enough, else its largest ones until enough) and
    retry; ``release_cached_blocks`` (every cached segment that is one free block, every
    pool and stream; free pages of expandable segments) and retry; else out of memory,
    with the figures torch's message reports (:class:`OutOfMemory`).

    Rule 7. Expandable segments (``try_allocate_expandable_block``, ``map_block``,
    ``unmap_block``): one segment per pool and stream, a virtual range mapped page by page
    (2 MiB small, ``large_segment_size`` large) at its lowest free address. A request no
    cached block serves maps only the pages it lacks, merged with the free block before
    them, not ``get_allocation_size``'s segment. Best fit sees a free block that ends at
    the unmapped tail as reaching to the end of the range (``expandable_size``) and prefers
    a smaller block that fits. Releasing unmaps the whole free pages.

    Rule 8. Garbage collection (``garbage_collect_cached_blocks``) acts only when a memory
    fraction is set (``set_fraction``) and ``garbage_collection_threshold`` > 0: before a
    new segment, while reserved > threshold x allowed, cached large segments that are one
    free block and at least as old as their average (in ``get_free_block`` calls since
    cached) are released.

    Not modelled: a block used on another stream (``record_stream``) is free at once here,
    not when that stream's work ends; CUDA-graph private pools; the free-memory callbacks;
    ``cudaMalloc`` failing below the capacity (driver fragmentation, other processes).
    Addresses are simulated, increasing in the order segments are reserved: they decide
    only ties between equal-size free blocks, as real addresses do, so such a tie may go
    the other way on a GPU.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Hashable
from dataclasses import dataclass

from remat.core.allocator_blocks import Block, BlockPools, PoolKey, SegmentInfo
from remat.core.allocator_settings import MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, AllocatorSettings
from remat.errors import RematError, message, one_line

_API = "CachingAllocatorModel"
_NO_CAPACITY_SPACE = 1 << 46  # an expandable segment's virtual range with no capacity given


@dataclass(frozen=True)
class OutOfMemory:
    """A request the allocator could not serve, with the figures of torch's OOM message.

    Args:
        requested_bytes: the bytes asked for.
        allocation_bytes: what torch's message says it "tried to allocate": the segment
            the request needed (``get_allocation_size``), bytes.
        allocated_bytes: bytes in allocated blocks when it failed ("allocated by PyTorch").
        reserved_bytes: bytes in segments when it failed, after releasing the cache.
        capacity_bytes: the memory the allocator may reserve, bytes.
        stream: the request's stream.

    Example:
        >>> oom = OutOfMemory(30 << 20, 30 << 20, 50 << 20, 60 << 20, 64 << 20, 0)
        >>> oom.reserved_unallocated_bytes >> 20, oom.free_bytes >> 20
        (10, 4)
    """

    requested_bytes: int
    allocation_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    capacity_bytes: int
    stream: int = 0

    @property
    def reserved_unallocated_bytes(self) -> int:
        """Reserved by the allocator but not allocated: its fragmentation at the failure."""
        return self.reserved_bytes - self.allocated_bytes

    @property
    def free_bytes(self) -> int:
        """Capacity not reserved."""
        return self.capacity_bytes - self.reserved_bytes

    def __str__(self) -> str:
        mib = 1 << 20
        return (f"CUDA out of memory (modelled). Tried to allocate "
                f"{self.allocation_bytes / mib:.2f} MiB. Capacity "
                f"{self.capacity_bytes / mib:.2f} MiB of which {self.free_bytes / mib:.2f} MiB "
                f"is free. Of the allocated memory {self.allocated_bytes / mib:.2f} MiB is "
                f"allocated by PyTorch, and {self.reserved_unallocated_bytes / mib:.2f} MiB is "
                "reserved by PyTorch but unallocated.")


class AllocatorOutOfMemory(RematError):
    """:meth:`CachingAllocatorModel.malloc` could not serve a request; ``.oom`` has the
    figures (:class:`OutOfMemory`)."""

    def __init__(self, text: str, oom: OutOfMemory) -> None:
        super().__init__(text)
        self.oom = oom


class CachingAllocatorModel(BlockPools):
    """PyTorch's CUDA caching allocator, replayed in Python: reserved bytes of a program.

    Each :meth:`malloc` and :meth:`free` follows ``DeviceCachingAllocator``'s rules (NOTE
    [ CUDA caching allocator model ]): best fit per pool and stream, splitting, merging,
    oversize blocks, expandable segments, release and retry when a capacity is reached.
    The trade-off against counting allocated bytes: a replay costs a few microseconds per
    event (sorted lists and bisection: 10^6 events take seconds), and it is exact only
    about what it models; addresses are simulated.

    Args:
        settings: the allocator's options. Default: torch's defaults.
        capacity_bytes: the memory the allocator may reserve (a device's free memory);
            ``None`` for no limit. With ``settings.per_process_memory_fraction`` the limit
            is that share of it. Default: ``None``.

    Raises:
        ValueError: ``backend:cudaMallocAsync`` (another allocator), or a capacity < 0.

    Example:
        >>> m = CachingAllocatorModel()
        >>> m.malloc("a", 1000)     # a 1024 B block of a new 2 MiB small segment
        1024
        >>> m.reserved_bytes >> 20, m.allocated_bytes
        (2, 1024)
        >>> m.free("a"); m.allocated_bytes, m.reserved_bytes >> 20
        (0, 2)
        >>> m.empty_cache(); m.reserved_bytes
        0
    """

    def __init__(self, settings: AllocatorSettings | None = None,
                 capacity_bytes: int | None = None) -> None:
        self.settings = settings = settings if settings is not None else AllocatorSettings()
        if settings.backend != "native":
            raise ValueError(message(_API, "the model is of the native caching allocator",
                                     {"backend": settings.backend},
                                     fix="model backend:native (cudaMallocAsync pools memory "
                                         "in the driver)"))
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(message(_API, "capacity_bytes must be >= 0",
                                     {"found": capacity_bytes}, fix="pass a byte count or None"))
        fraction = settings.per_process_memory_fraction
        space = capacity_bytes if capacity_bytes is not None else _NO_CAPACITY_SPACE
        super().__init__(  # allowed_memory_maximum when a fraction is set (set_fraction)
            capacity_bytes, int(fraction * capacity_bytes)
            if fraction is not None and capacity_bytes is not None else None,
            space + space // 8, settings.large_segment_size_bytes)  # 1 1/8 of the device
        self._gc = self._allowed is not None and settings.garbage_collection_threshold > 0
        self._max_split = settings.max_split_bytes
        self._rounding = settings.non_split_rounding_bytes
        self._expandable = settings.expandable_segments
        self._live: dict[Hashable, Block | None] = {}
        self.allocated_bytes = 0
        self.requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_requested_bytes = 0
        self.alloc_retries = 0

    # ---- the public calls ----------------------------------------------------------------

    def malloc(self, key: Hashable, size_bytes: int, stream: int = 0) -> int:
        """Allocate ``size_bytes`` on ``stream`` under ``key``; return the block's bytes.

        A zero-byte request takes no block (torch returns a null pointer), as it returns 0.

        Args:
            key: names the allocation for :meth:`free` (a storage's id, say).
            size_bytes: the bytes requested (a storage's ``nbytes``).
            stream: the stream it is allocated on (NOTE [ CUDA caching allocator model ],
                Rule 2). Default: 0.

        Raises:
            AllocatorOutOfMemory: nothing fits within the capacity (Rule 6).
            ValueError: ``key`` is live, or ``size_bytes`` < 0.
        """
        if key in self._live:
            raise ValueError(message(f"{_API}.malloc", f"{key!r} is already allocated",
                                     fix="free it first, or use a new key"))
        if size_bytes <= 0:
            if size_bytes < 0:
                raise ValueError(message(f"{_API}.malloc", "size_bytes must be >= 0",
                                         {"found": size_bytes}, fix="pass a byte count"))
            self._live[key] = None
            return 0
        size = self.settings.round_size(size_bytes)
        small = size <= SMALL_SIZE_BYTES
        pool = (small, stream)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._new_block(pool, size, size_bytes)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK_BYTES if small or self._expandable
                else size < self._max_split and remaining > SMALL_SIZE_BYTES):
            block = self._split(block, size)
        block.allocated = True
        block.requested = size_bytes
        self._live[key] = block
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        self.requested_bytes += size_bytes
        if self.requested_bytes > self.peak_requested_bytes:
            self.peak_requested_bytes = self.requested_bytes
        return block.size

    def free(self, key: Hashable) -> None:
        """Free the allocation ``key``: its block returns to its pool and merges with free
        neighbours (Rule 5); reserved bytes do not change.

        Raises:
            KeyError: ``key`` is not allocated.
        """
        try:
            block = self._live.pop(key)
        except KeyError:
            raise KeyError(one_line(message(f"{_API}.free", f"{key!r} is not allocated",
                                            fix="free only keys that malloc returned"))) from None
        if block is None:
            return
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.allocated = False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_free(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment that is one free block
        and the free pages of expandable segments (``release_cached_blocks``)."""
        self._release_cached_blocks()

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: peaks start again from now."""
        self.peak_allocated_bytes = self.allocated_bytes
        self.peak_requested_bytes = self.requested_bytes
        self.peak_reserved_bytes = self.reserved_bytes

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def block_bytes(self, key: Hashable) -> int:
        """The bytes of the block serving ``key`` (0 for a zero-byte allocation)."""
        block = self._live[key]
        return block.size if block is not None else 0

    @property
    def cached_free_bytes(self) -> int:
        """Bytes in cached free blocks: reserved but not allocated."""
        return self.reserved_bytes - self.allocated_bytes

    def segments(self) -> list[SegmentInfo]:
        """Each segment as ``(stream, mapped bytes, small pool, ((block bytes, state), ...))``
        in address order, ``state`` one of ``"allocated"``, ``"free"``, ``"unmapped"`` (an
        expandable segment's range not backed by pages): ``torch.cuda.memory_snapshot()``
        in miniature."""
        return self.segment_list([b for b in self._live.values() if b is not None])

    # ---- the policy ----------------------------------------------------------------------

    def _get_free_block(self, pool: PoolKey, size: int) -> Block | None:
        """``get_free_block`` (Rules 2, 3 and 7)."""
        if self._gc:
            self._gc_calls[pool[0]] += 1
        blocks = self._free.get(pool)
        if not blocks:
            return None
        i = bisect_left(blocks, (size,))
        if i == len(blocks):
            return None
        if blocks[i][2].segment is not None:  # NOTE [ CUDA caching allocator model ], Rule 7
            while (blocks[i][2].segment is not None and i + 1 < len(blocks)
                   and blocks[i + 1][2].reach < blocks[i][2].reach):
                i += 1
        found = blocks[i][0]
        if size < self._max_split <= found:
            return None
        if size >= self._max_split and found >= size + self._rounding:
            return None
        return blocks.pop(i)[2]

    # ---- new segments, release, out of memory ----------------------------------------------

    def _new_block(self, pool: PoolKey, size: int, size_bytes: int) -> Block:
        """``malloc``'s path when no cached block fits (NOTE [ CUDA caching allocator
        model ], Rule 6): a new segment, after releasing the cache if it has to."""
        segment_bytes = self.settings.segment_size(size)
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, size, segment_bytes)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, segment_bytes)
        if block is None:
            self._release_cached_blocks()
            self.alloc_retries += 1
            block = self._alloc_block(pool, size, segment_bytes)
        if block is None:
            capacity = self._allowed if self._allowed is not None else self.capacity_bytes
            oom = OutOfMemory(size_bytes, segment_bytes, self.allocated_bytes,
                              self.reserved_bytes, capacity or 0, pool[1])
            raise AllocatorOutOfMemory(message(
                f"{_API}.malloc", "out of memory", {"figures": str(oom)},
                fix="lower the step's peak, or model expandable_segments:True if reserved but "
                    "unallocated memory is large"), oom)
        return block

    def _alloc_block(self, pool: PoolKey, size: int, segment_bytes: int) -> Block | None:
        """``alloc_block``: a new segment of ``segment_bytes``, or with expandable segments
        the pages ``size`` needs; ``None`` past the capacity."""
        if self._allowed is not None and self.reserved_bytes + segment_bytes > self._allowed:
            return None  # set_fraction's check, on the full segment even when expandable
        if self._expandable:
            return self._expand(pool, size)
        if not self._fits(segment_bytes):
            return None
        return self._new_segment(pool, segment_bytes)

    def _release_available_cached_blocks(self, pool: PoolKey, size: int) -> bool:
        """``release_available_cached_blocks`` (Rule 6): only with ``max_split_size``; not
        for expandable segments (whose blocks torch's ``release_block`` refuses)."""
        if self.settings.max_split_size_bytes is None or self._expandable:
            return False
        blocks = self._free.get(pool, [])
        target = max(size, self._max_split)
        i = bisect_left(blocks, (target,))
        if i < len(blocks):
            self._release_block(blocks[i][2])
            return True
        released = 0
        j = i - 1
        while j >= 0 and released < target and blocks[j][0] >= self._max_split:
            released += blocks[j][0]
            self._release_block(blocks[j][2])
            j -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: ``release_blocks`` on the large pool, then the small."""
        self._release_pool(False)
        self._release_pool(True)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks`` (NOTE [ CUDA caching allocator model ], Rule 8)."""
        assert self._allowed is not None
        threshold = int(self.settings.garbage_collection_threshold * self._allowed)
        if self.reserved_bytes <= threshold:
            return
        target, reclaimed = self.reserved_bytes - threshold, 0
        calls = self._gc_calls[False]

        def freeable() -> list[Block]:  # large_blocks in (stream, size, address) order
            return [b for (small, _), lst in sorted(self._free.items()) if not small
                    for _, _, b in lst if b.prev is None and b.next is None]

        ages = [calls - b.gc_base for b in freeable()]
        total_age, count = sum(ages), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for block in freeable():
                if calls - block.gc_base >= threshold_age:
                    freed = True
                    reclaimed += block.size
                    total_age -= calls - block.gc_base
                    count -= 1
                    self._release_block(block)
