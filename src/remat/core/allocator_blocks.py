"""The memory of the caching allocator model: segments, their blocks, the cached free blocks.

The layout half of :class:`~remat.core.caching_allocator.CachingAllocatorModel`: blocks
linked within their segment, free blocks cached per pool and stream in lists sorted by
``(size, address)`` (the ``std::set`` ordered by ``BlockComparatorSize`` in
``c10/cuda/CUDACachingAllocator.cpp``), and the page mapping of expandable segments. The
policy (which block serves a request, when to release) is in caching_allocator.py; the
rules are NOTE [ CUDA caching allocator model ] there.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from remat.core.allocator_settings import SMALL_BUFFER_BYTES

_PAGE_ALIGN = 2 << 20  # simulated segment addresses start on 2 MiB boundaries

#: A pool: (small pool, stream).
PoolKey = tuple[bool, int]
#: A segment as :meth:`BlockPools.segment_list` reports it: (stream, mapped bytes, small
#: pool, ((block bytes, "allocated" | "free" | "unmapped"), ...) in address order).
SegmentInfo = tuple[int, int, bool, tuple[tuple[int, str], ...]]


class Segment:
    """An expandable segment's virtual range (``ExpandableSegment``): its start, its page
    and the bytes mapped (a segment with none holds no memory and is not counted)."""

    __slots__ = ("base", "mapped_bytes", "page")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page
        self.mapped_bytes = 0


class Block:
    """One block of a segment (``Block`` in the source): free, allocated or unmapped."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "prev", "requested",
                 "segment", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool,
                 segment: Segment | None = None) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.segment = segment  # the expandable segment, None for a cudaMalloc'd one
        self.allocated = False
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_base = 0  # get_free_blocks_call_count when cached (garbage collection)
        self.requested = 0  # the bytes requested, when allocated

    @property
    def reach(self) -> int:
        """``expandable_size``: the block's size plus the unmapped range right after it."""
        following = self.next
        return self.size + (following.size if following is not None and not following.mapped
                            else 0)


class BlockPools:
    """Segments and cached free blocks, with the reserved bytes they hold.

    Args:
        capacity_bytes: what may be reserved (``cudaMalloc`` fails past it); ``None``: no limit.
        allowed_bytes: the memory-fraction limit (``allowed_memory_maximum``), or ``None``.
        space_bytes: an expandable segment's virtual range (torch: 1 1/8 of the device).
        large_page_bytes: the large pool's expandable page (``large_segment_size``).
    """

    def __init__(self, capacity_bytes: int | None, allowed_bytes: int | None,
                 space_bytes: int, large_page_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._allowed = allowed_bytes
        self._space = space_bytes
        self._large_page = large_page_bytes
        self._free: dict[PoolKey, list[tuple[int, int, Block]]] = {}  # by (size, address)
        self._unmapped: dict[PoolKey, list[tuple[int, Block]]] = {}  # by address
        self._gc_calls = {True: 0, False: 0}  # get_free_blocks_call_count per pool
        self._next_addr = _PAGE_ALIGN
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.segment_count = 0

    # ---- cached free blocks ----------------------------------------------------------------

    def _insert_free(self, block: Block) -> None:
        """``insert_into_blocks``: cache ``block`` in its pool, its age starting now."""
        block.gc_base = self._gc_calls[block.small]
        key = (block.small, block.stream)
        blocks = self._free.get(key)
        if blocks is None:
            self._free[key] = [(block.size, block.addr, block)]
        else:
            insort(blocks, (block.size, block.addr, block))

    def _remove_free(self, block: Block) -> None:
        blocks = self._free[(block.small, block.stream)]
        del blocks[bisect_left(blocks, (block.size, block.addr))]

    def _remove_unmapped(self, block: Block) -> None:
        unmapped = self._unmapped[(block.small, block.stream)]
        del unmapped[bisect_left(unmapped, (block.addr,))]

    def _merge(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: ``src`` (a free neighbour in the same mapped state) joins
        ``dst``, which is in no list; return the bytes merged."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _split(self, block: Block, size: int) -> Block:
        """``alloc_found_block`` with ``split_remainder``: the front ``size`` bytes are the
        new block; the rest stays cached."""
        front = Block(block.addr, size, block.stream, block.small, block.segment)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        self._insert_free(block)
        return front

    @property
    def largest_free_block_bytes(self) -> int:
        """The largest cached free block, any pool and stream (``cacheInfo``): the largest
        request served without a new segment."""
        return max((blocks[-1][0] for blocks in self._free.values() if blocks), default=0)

    def segment_list(self, allocated: list[Block]) -> list[SegmentInfo]:
        """Every segment, in address order, given the ``allocated`` blocks."""
        blocks = allocated + [b for lst in self._free.values() for _, _, b in lst]
        blocks += [b for lst in self._unmapped.values() for _, b in lst]
        out = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.addr):
            parts: list[tuple[int, str]] = []
            cur: Block | None = head
            while cur is not None:
                state = "unmapped" if not cur.mapped else "allocated" if cur.allocated else "free"
                parts.append((cur.size, state))
                cur = cur.next
            mapped = sum(size for size, state in parts if state != "unmapped")
            if mapped:
                out.append((head.stream, mapped, head.small, tuple(parts)))
        return out

    # ---- segments ----------------------------------------------------------------------

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more can be reserved (``cudaMalloc`` / ``cuMemCreate``)."""
        if self._allowed is not None and self.reserved_bytes + nbytes > self._allowed:
            return False
        return self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _take_addresses(self, nbytes: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-nbytes // _PAGE_ALIGN) * _PAGE_ALIGN + _PAGE_ALIGN
        return addr

    def _new_segment(self, pool: PoolKey, nbytes: int) -> Block:
        """``alloc_block``'s ``cudaMalloc``: a segment of ``nbytes`` as one block, in no list."""
        block = Block(self._take_addresses(nbytes), nbytes, pool[1], pool[0])
        self._reserve(nbytes)
        self.segment_count += 1
        return block

    def _release_block(self, block: Block) -> None:
        """``release_block``: give a cached segment that is one free block back."""
        self._remove_free(block)
        self.reserved_bytes -= block.size
        self.segment_count -= 1

    # ---- expandable segments (NOTE [ CUDA caching allocator model ], Rule 7) ------------

    def _expand(self, pool: PoolKey, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free block of ``size``
        exists at the lowest address possible; take it out of the pool."""
        candidate = self._find_expandable(pool, size)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None
            if not self._map(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove_free(candidate)
        return candidate

    def _find_expandable(self, pool: PoolKey, size: int) -> Block:
        """``find_expandable_block``: the lowest unmapped range (with the free block before
        it) that reaches ``size``, or a new segment's whole range."""
        for _, block in self._unmapped.get(pool, []):
            start: Block = block
            if block.prev is not None and not block.prev.allocated:
                start = block.prev
            walk: Block | None
            reach, walk = 0, start  # has_available_address_space
            while walk is not None and reach < size and not walk.allocated:
                reach += walk.size
                walk = walk.next
            if reach >= size:
                return start
        page = SMALL_BUFFER_BYTES if pool[0] else self._large_page
        space = -(-self._space // page) * page
        segment = Segment(self._take_addresses(space), page)
        block = Block(segment.base, space, pool[1], pool[0], segment)
        block.mapped = False
        insort(self._unmapped.setdefault(pool, []), (block.addr, block))
        return block

    def _map(self, block: Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of unmapped ``block`` with pages;
        the mapped part merges with free neighbours and is cached."""
        segment = block.segment
        assert segment is not None
        page, offset = segment.page, block.addr - segment.base
        mapped = -(-(offset + size) // page) * page - offset
        if not self._fits(mapped):
            return False
        self._remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small,
                         segment)
            rest.mapped = False
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            insort(self._unmapped[(block.small, block.stream)], (rest.addr, rest))
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert_free(block)
        self._reserve(mapped)
        if not segment.mapped_bytes:
            self.segment_count += 1
        segment.mapped_bytes += mapped
        return True

    def _unmap(self, block: Block) -> None:
        """``unmap_block``: return the whole pages inside free ``block`` to the device."""
        segment = block.segment
        assert segment is not None
        page, base = segment.page, segment.base
        begin = base + -(-(block.addr - base) // page) * page
        end = base + (block.addr + block.size - base) // page * page
        if begin >= end:
            return
        self._remove_free(block)
        if begin > block.addr:
            before = Block(block.addr, begin - block.addr, block.stream, block.small, segment)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._insert_free(before)
        if end < block.addr + block.size:
            after = Block(end, block.addr + block.size - end, block.stream, block.small,
                          segment)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert_free(after)
        block.addr, block.size, block.mapped = begin, end - begin, False
        self.reserved_bytes -= end - begin
        segment.mapped_bytes -= end - begin
        if not segment.mapped_bytes:
            self.segment_count -= 1
        self._merge(block, block.prev)
        self._merge(block, block.next)
        insort(self._unmapped.setdefault((block.small, block.stream), []), (block.addr, block))

    def _release_pool(self, small: bool) -> None:
        """``release_blocks``: every cached segment of the pool that is one free block goes
        back; expandable segments give back their free pages, and go when none is left."""
        to_unmap: list[Block] = []
        for (is_small, _), blocks in sorted(self._free.items()):
            if is_small != small:
                continue
            for _, _, block in list(blocks):
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
        for block in to_unmap:
            self._unmap(block)
            if block.prev is None and block.next is None and not block.mapped:
                self._remove_unmapped(block)  # release_expandable_segment
