"""A simulation of PyTorch's CUDA caching allocator, replayed over a trace.

The trace gives the ordered stream of tensor allocations and frees of a
training step. What the GPU holds is not their sum: the caching allocator
(c10/cuda/CUDACachingAllocator.cpp) carves requests out of larger cudaMalloc
*segments*, keeps freed blocks cached instead of returning them to the driver,
and only frees cached segments when a cudaMalloc fails. :func:`replay` runs the
stream through a block-level model of that code and returns the peaks that
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` report.

Every rule below names the function of CUDACachingAllocator.cpp it follows.
They were read in torch 2.6 and in the newest source (the 2.13 line); the rules
modelled here are the same in both unless a comment says otherwise. Against
torch 2.13's own allocator (run on the stub CUDA device) the replay agrees on
the allocated and reserved bytes after every event, the peaks and the OOM
event: ``benchmarks/stub_allocator.py``, results in ``benchmarks/results``.

Known limitations:
    * One device, one stream. Cross-stream frees (``record_stream``) and CUDA
      graph private pools are not modelled.
    * ``backend:cudaMallocAsync`` is a different allocator and is refused.
    * Free-memory callbacks registered by other libraries are not run.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from llmem_plugin.device.allocator_config import (
    MIN_BLOCK_SIZE,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    AllocatorConfig,
)
from llmem_plugin.errors import ConfigError

__all__ = ["AllocatorConfig", "AllocatorResult", "CachingAllocator", "SimulatedOOM", "replay"]

# Address space of an expandable segment when the device memory is unknown.
# With it known, the segment spans 1 1/8 of the device memory in whole pages
# (ExpandableSegment's constructor: numSegments(totalGlobalMem +
# totalGlobalMem / 8) pages), and find_expandable_block opens a second
# segment once the first has no room left.
_EXPANDABLE_ADDRESS_SPACE = 1 << 44
# Gap between simulated segments so blocks of different segments never touch.
_SEGMENT_GAP = 1 << 30
# Where top-down large segments start (AllocatorConfig.large_segments_descend): far above the
# bottom-up ones, so the two never meet.
_DESCENDING_TOP = 1 << 62
_ADDRESS_SPACE = 1 << 46  # 64 TiB of simulated addresses per stream's allocator (address_space=)


class SimulatedOOM(Exception):
    """Raised by :meth:`CachingAllocator.malloc` when the request cannot be met
    even after freeing every cached segment (torch raises OutOfMemoryError)."""


class _Block:
    """A contiguous range of one segment: allocated, free, or (expandable only) unmapped."""

    __slots__ = ("addr", "allocated", "gc_base", "mapped", "next", "prev", "requested", "segment", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, segment: _Segment) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.allocated = False
        self.mapped = True
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment
        self.gc_base = 0
        self.requested = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def split(self, size: int) -> _Block:
        """Keep the first ``size`` bytes; return the rest as a new block linked after this one."""
        rest = _Block(self.addr + size, self.size - size, self.small, self.segment)
        rest.mapped = self.mapped
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next = rest
        self.size = size
        return rest


@dataclass(eq=False)
class _Segment:
    base: int
    expandable: bool
    page_bytes: int = 0  # mapping granularity of an expandable segment


class _Pool:
    """Free blocks of one pool, ordered as BlockComparatorSize orders them:
    by size, then by address (single stream)."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped: list[int] = []  # addresses, BlockComparatorAddress order
        self.unmapped_blocks: dict[int, _Block] = {}
        self.get_free_blocks_call_count = 0

    def insert(self, b: _Block) -> None:
        # BlockPool::insert_into_blocks stamps the GC age base.
        b.gc_base = self.get_free_blocks_call_count
        bisect.insort(self.keys, (b.size, b.addr))
        self.blocks[b.addr] = b

    def erase(self, b: _Block) -> None:
        i = bisect.bisect_left(self.keys, (b.size, b.addr))
        assert self.keys[i] == (b.size, b.addr), "free block missing from its pool"
        del self.keys[i]
        del self.blocks[b.addr]

    def contains(self, b: _Block) -> bool:
        return self.blocks.get(b.addr) is b

    def lower_bound(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))

    def insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped, b.addr)
        self.unmapped_blocks[b.addr] = b

    def erase_unmapped(self, b: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, b.addr)
        del self.unmapped[i]
        del self.unmapped_blocks[b.addr]


@dataclass(frozen=True, kw_only=True)
class AllocatorResult:
    """What the simulated allocator saw over a replayed event stream.

    Attributes:
        peak_allocated_bytes: Peak of allocated block bytes
            (``torch.cuda.max_memory_allocated``). Above the sum of requests
            where a block was not split (e.g. an 11 MiB tensor holds 12 MiB).
        peak_reserved_bytes: Peak of segment bytes held from the driver
            (``torch.cuda.max_memory_reserved``).
        peak_requested_bytes: Peak of the bytes the tensors asked for.
        reserved_at_end_bytes: Segments still held after the last event.
        fragmentation: ``1 - allocated / reserved`` at the reserved peak.
        num_segments: Segments held at the end.
        num_alloc_retries: cudaMalloc failures that freed cached segments and retried.
        oom: Whether a request could not be met within ``capacity_bytes``.
        oom_event: Index of the failing event, or -1.
        phase_allocated_bytes: Peak allocated within each labelled phase
            (when :func:`replay` was given labels).
        phase_reserved_bytes: Reserved peak up to the end of each labelled phase.
        timeline: ``(event index, label, allocated bytes, reserved bytes)``
            after each event, thinned (when :func:`replay` was asked for
            ``timeline_points``); empty otherwise.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    reserved_at_end_bytes: int
    fragmentation: float
    num_segments: int
    num_alloc_retries: int
    oom: bool = False
    oom_event: int = -1
    phase_allocated_bytes: dict[str, int] = field(default_factory=dict)
    phase_reserved_bytes: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[int, str, int, int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class _Stats:
    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    allocated_at_peak_reserved: int = 0
    num_alloc_retries: int = 0
    segments: set = field(default_factory=set)


class CachingAllocator:
    """Block-level model of ``DeviceCachingAllocator`` for one device and stream.

    Args:
        config: Parsed ``PYTORCH_CUDA_ALLOC_CONF``.
        capacity_bytes: Bytes cudaMalloc can hand out (device memory minus the
            CUDA context and other non-PyTorch allocations); None = unlimited.
        memory_fraction: ``torch.cuda.set_per_process_memory_fraction`` value;
            below 1.0 the cap is ``memory_fraction * device_memory_bytes``,
            and ``garbage_collection_threshold`` applies (only then does the
            allocator collect, DeviceCachingAllocator::malloc). 1.0 is no
            limit, as in setMemoryFraction().
        device_memory_bytes: Total device memory (``totalGlobalMem``), needed
            with ``memory_fraction``; it also sizes expandable segments'
            address space (1 1/8 of it; about 16 TiB when None).
        address_space: Which range of simulated addresses the segments take (0 by default; one per
            stream where each stream's pool is replayed by its own allocator).
    """

    def __init__(
        self,
        config: AllocatorConfig | None = None,
        *,
        capacity_bytes: int | None = None,
        memory_fraction: float | None = None,
        device_memory_bytes: int | None = None,
        address_space: int = 0,
    ) -> None:
        self.config = config or AllocatorConfig()
        if self.config.backend != "native":
            raise ConfigError(
                f"allocator backend '{self.config.backend}' is not modelled; only the native caching allocator is. "
                "HINT: drop backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF"
            )
        self.capacity_bytes = capacity_bytes
        self.device_memory_bytes = device_memory_bytes
        self.allowed_max: int | None = None
        if memory_fraction is not None:
            if not 0.0 < memory_fraction <= 1.0 or device_memory_bytes is None:
                raise ConfigError(
                    f"memory_fraction must be in (0, 1] and needs device_memory_bytes, got {memory_fraction!r}. "
                    "HINT: pass the GPU's total memory with it"
                )
            # setMemoryFraction(): allowed_memory_maximum is set only below
            # 1.0; a fraction of 1.0 means no limit (and no garbage collection).
            if memory_fraction < 1.0:
                self.allowed_max = int(memory_fraction * device_memory_bytes)
        self.small = _Pool(small=True)
        self.large = _Pool(small=False)
        self.stats = _Stats()
        self._live: dict[int, _Block] = {}
        # Simulated addresses; allocators that stand for one device's streams take apart ranges
        # (address_space = the stream's number), so their snapshot entries never share an address.
        self._next_base = _SEGMENT_GAP + address_space * _ADDRESS_SPACE
        # With config.large_segments_descend, new large segments are placed top-down from here.
        self._next_top = _DESCENDING_TOP - address_space * _ADDRESS_SPACE
        # When a list: every action, as ``(action, address, bytes, block bytes)`` in the order
        # torch's _record_memory_history records them (TraceEntry::Action); block bytes differ from
        # bytes for an allocation (its block, rounded and perhaps unsplit) and are bytes otherwise.
        self.history: list[tuple[str, int, int, int]] | None = None

    def _note(self, action: str, addr: int, nbytes: int, block: int | None = None) -> None:
        if self.history is not None:
            self.history.append((action, addr, nbytes, nbytes if block is None else block))

    # ------------------------------------------------------------ sizing rules
    def round_size(self, size: int) -> int:
        """round_size(): at least kMinBlockSize, then a multiple of it, or the
        next power-of-two division when roundup_power2_divisions applies."""
        if size < MIN_BLOCK_SIZE:
            return MIN_BLOCK_SIZE
        divisions = self.config.divisions_for(size)
        if divisions > 1 and size > MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(size, divisions)
        return -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE

    def allocation_size(self, size: int) -> int:
        """get_allocation_size(): the cudaMalloc size for a rounded request
        (kLargeBuffer is ``large_segment_size()`` from torch 2.11)."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return self.config.large_segment_bytes
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _should_split(self, block: _Block, size: int) -> bool:
        """should_split(): small and expandable blocks split down to 512 B;
        large blocks only below max_split_size and leaving more than 1 MiB."""
        remaining = block.size - size
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        return size < self.config.max_split_bytes and remaining > SMALL_SIZE

    # ------------------------------------------------------------ public API
    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns the block address (the handle for :meth:`free`).

        Raises:
            SimulatedOOM: The request does not fit even after freeing the cache.
        """
        size = self.round_size(nbytes)
        pool = self.small if size <= SMALL_SIZE else self.large
        alloc_size = self.allocation_size(size)
        block = self._get_free_block(pool, size)
        if block is None:
            # DeviceCachingAllocator::malloc collects garbage only when no
            # cached block fits (inside ``if (!block_found)``), before cudaMalloc.
            if self.allowed_max is not None and self.config.garbage_collection_threshold > 0.0:
                self._garbage_collect()
            block = (
                self._alloc_block(pool, size, alloc_size)
                or (self._release_available_cached_blocks(pool, size) and self._alloc_block(pool, size, alloc_size))
                or (self._release_cached_blocks() and self._alloc_block(pool, size, alloc_size, retry=True))
            )
            if not block:
                # DeviceCachingAllocator::malloc records TraceEntry::OOM before raising, with params.size():
                # the request as round_size() rounded it.
                self._note("oom", 0, size)
                raise SimulatedOOM(
                    f"request of {nbytes} B: {self.stats.allocated} B allocated, {self.stats.reserved} B reserved"
                )
        if self._should_split(block, size):
            # The request takes the low-address part; the remainder stays free.
            pool.insert(block.split(size))
        block.allocated = True
        block.requested = nbytes
        self._live[block.addr] = block
        st = self.stats
        st.allocated += block.size
        st.requested += nbytes
        st.peak_allocated = max(st.peak_allocated, st.allocated)
        st.peak_requested = max(st.peak_requested, st.requested)
        self._note("alloc", block.addr, nbytes, block.size)  # TraceEntry::ALLOC carries the size asked for
        return block.addr

    def free(self, addr: int) -> None:
        """free_block(): return the block to its pool, merged with free neighbours."""
        block = self._live.pop(addr)
        # free(): FREE_REQUESTED, then (no other stream uses the block) free_block()'s FREE_COMPLETED,
        # both with the block's requested size.
        self._note("free_requested", block.addr, block.requested, block.size)
        self._note("free_completed", block.addr, block.requested, block.size)
        block.allocated = False
        self.stats.allocated -= block.size
        self.stats.requested -= block.requested
        pool = self.small if block.small else self.large
        for cand in (block.prev, block.next):
            self._try_merge(block, cand, pool)
        pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every unsplit cached segment."""
        self._release_cached_blocks()

    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peaks restart from the current values."""
        st = self.stats
        st.peak_allocated, st.peak_requested = st.allocated, st.requested
        st.peak_reserved, st.allocated_at_peak_reserved = st.reserved, st.allocated

    def segment_blocks(self) -> list[list[_Block]]:
        """Each held segment's blocks in address order (an expandable segment's unmapped ranges included:
        ``mapped`` is False on them), segments in address order."""
        heads = {}
        for pool in (self.small, self.large):
            for b in [*pool.blocks.values(), *pool.unmapped_blocks.values()]:
                heads.setdefault(id(b.segment), b)
        for b in self._live.values():
            heads.setdefault(id(b.segment), b)
        out = []
        for b in sorted(heads.values(), key=lambda b: b.segment.base):
            while b.prev is not None:
                b = b.prev
            blocks = []
            while b is not None:
                blocks.append(b)
                b = b.next
            out.append(blocks)
        return out

    def segments(self) -> list[list[tuple[int, bool]]]:
        """Each held segment as its blocks' (size, allocated), in address order
        (unmapped parts of expandable segments left out)."""
        out = []
        for seg in self.segment_blocks():
            blocks = [(b.size, b.allocated) for b in seg if b.mapped]
            if blocks:
                out.append(blocks)
        return out

    # ------------------------------------------------------------ internals
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """get_free_block(): best fit (smallest size, then lowest address)."""
        if self.allowed_max is not None and self.config.garbage_collection_threshold > 0.0:
            pool.get_free_blocks_call_count += 1
        i = pool.lower_bound(size)
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i][1]]
        if block.segment.expandable:
            # An expandable block counts at the size it can grow to (it plus the
            # unmapped range after it); prefer the smallest such candidate.
            def grow(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

            while block.segment.expandable and i + 1 < len(pool.keys):
                nxt = pool.blocks[pool.keys[i + 1][1]]
                if grow(nxt) >= grow(block):
                    break
                i, block = i + 1, nxt
        cfg = self.config
        # Do not return an oversized block for a small request.
        if size < cfg.max_split_bytes and block.size >= cfg.max_split_bytes:
            return None
        # Do not return an oversized block for a large request (the slack allowed
        # is kLargeBuffer up to 2.6, max_non_split_rounding_size since 2.7; both 20 MiB by default).
        if size >= cfg.max_split_bytes and block.size >= size + cfg.max_non_split_rounding_bytes:
            return None
        pool.erase(block)
        return block

    def _fits_device(self, nbytes: int) -> bool:
        """Whether cudaMalloc / cuMemCreate can hand out ``nbytes`` more."""
        return self.capacity_bytes is None or self.stats.reserved + nbytes <= self.capacity_bytes

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, *, retry: bool = False) -> _Block | None:
        """alloc_block(): a new segment from cudaMalloc, or (expandable) more pages mapped.

        The memory-fraction cap (``allowed_memory_maximum``) is checked first,
        against the allocation size, on both paths: an expandable request is
        refused when reserved + get_allocation_size() passes the cap, even
        where mapping fewer pages would have stayed under it. The capacity is
        the driver's: cudaMalloc, or cuMemCreate per page in map_block().
        """
        if retry:
            self.stats.num_alloc_retries += 1
        if self.allowed_max is not None and self.stats.reserved + alloc_size > self.allowed_max:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if not self._fits_device(alloc_size):
            return None
        if self.config.large_segments_descend and not pool.small:
            self._next_top -= alloc_size + _SEGMENT_GAP
            seg = _Segment(base=self._next_top, expandable=False)
        else:
            seg = _Segment(base=self._next_base, expandable=False)
            self._next_base += alloc_size + _SEGMENT_GAP
        self._add_reserved(alloc_size)
        self.stats.segments.add(seg.base)
        self._note("segment_alloc", seg.base, alloc_size)
        return _Block(seg.base, alloc_size, pool.small, seg)

    def _add_reserved(self, nbytes: int) -> None:
        st = self.stats
        st.reserved += nbytes
        if st.reserved > st.peak_reserved:
            st.peak_reserved = st.reserved
            st.allocated_at_peak_reserved = st.allocated

    def _try_merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        """try_merge_blocks(): absorb a free neighbour in the same mapping state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
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

    def _release_block(self, block: _Block, pool: _Pool) -> None:
        """release_block(): cudaFree a whole cached segment."""
        pool.erase(block)
        self.stats.reserved -= block.size
        self.stats.segments.discard(block.segment.base)
        self._note("segment_free", block.addr, block.size)

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        """release_available_cached_blocks(): with max_split_size set, free the
        smallest oversize cached block that covers the request, else the
        largest ones until enough is freed."""
        cfg = self.config
        if not cfg.max_split_size_bytes:
            return False
        key = max(size, cfg.max_split_bytes)
        i = pool.lower_bound(key)
        if i < len(pool.keys) and not pool.blocks[pool.keys[i][1]].segment.expandable:
            self._release_block(pool.blocks[pool.keys[i][1]], pool)
            return True
        released = 0
        j = i - 1
        while released < key and j >= 0:
            b = pool.blocks[pool.keys[j][1]]
            if b.size < cfg.max_split_bytes:
                break
            if not b.segment.expandable:
                self._release_block(b, pool)
                released += b.size
            j -= 1
        return released >= key

    def _release_cached_blocks(self) -> bool:
        """release_cached_blocks(): free every unsplit cached segment of both
        pools, and unmap the free pages of expandable segments."""
        for pool in (self.large, self.small):
            to_unmap = []
            # release_blocks() walks the pool's std::set, ordered by BlockComparatorSize (size, then address).
            for b in [pool.blocks[a] for _, a in list(pool.keys)]:
                if b.segment.expandable:
                    to_unmap.append(b)
                elif not b.is_split:
                    self._release_block(b, pool)
            for b in to_unmap:
                self._unmap_block(b, pool)
        return True

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks(): above threshold x cap, free unsplit
        large cached segments older (in get_free_block calls) than average."""
        assert self.allowed_max is not None
        threshold = int(self.config.garbage_collection_threshold * self.allowed_max)
        if self.stats.reserved <= threshold:
            return
        target = self.stats.reserved - threshold
        pool = self.large

        def age(b: _Block) -> int:
            return pool.get_free_blocks_call_count - b.gc_base

        freeable = [b for b in pool.blocks.values() if not b.is_split]
        total_age = sum(age(b) for b in freeable)
        count = len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for b in [pool.blocks[a] for _, a in list(pool.keys)]:
                if not b.is_split and not b.segment.expandable and age(b) >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age(b)
                    count -= 1
                    self._release_block(b, pool)

    # ------------------------------------------------------ expandable segments
    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block(): map pages at the end of the free
        range that best starts a run of ``size`` allocatable bytes."""
        cand = self._find_expandable_block(pool, size)
        if not cand.mapped and not self._map_block(cand, min(cand.size, size), pool):
            return None
        while cand.size < size:
            nxt = cand.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - cand.size, nxt.size), pool):
                return None
            cand = nxt  # map_block merged the previous candidate into it
        pool.erase(cand)
        return cand

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """find_expandable_block(): the lowest-address unmapped range (with the
        free block before it) that has ``size`` bytes; else a new segment."""

        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for addr in pool.unmapped:
            c = pool.unmapped_blocks[addr]
            if allocatable(c.prev):
                c = c.prev
            b, room = c, 0
            while room < size and allocatable(b):
                room += b.size
                b = b.next
            if room >= size:
                return c
        # ExpandableSegment segment_size: kSmallBuffer, or kLargeBuffer / large_segment_size().
        page = SMALL_BUFFER if pool.small else self.config.large_segment_bytes
        if self.device_memory_bytes is None:
            space = _EXPANDABLE_ADDRESS_SPACE
        else:
            total = self.device_memory_bytes
            space = -(-(total + total // 8) // page) * page
        seg = _Segment(base=self._next_base, expandable=True, page_bytes=page)
        self._next_base += space + _SEGMENT_GAP
        self.stats.segments.add(seg.base)
        blk = _Block(seg.base, space, pool.small, seg)
        blk.mapped = False
        pool.insert_unmapped(blk)
        return blk

    def _map_block(self, blk: _Block, size: int, pool: _Pool) -> bool:
        """map_block(): map whole pages covering ``size`` bytes at the block's start."""
        page = blk.segment.page_bytes
        mapped = min(-(-size // page) * page, blk.size)
        if not self._fits_device(mapped):
            return False
        pool.erase_unmapped(blk)
        at = blk.addr
        if mapped < blk.size:
            pool.insert_unmapped(blk.split(mapped))  # the rest stays unmapped
        blk.mapped = True
        self._try_merge(blk, blk.prev, pool)
        self._try_merge(blk, blk.next, pool)
        pool.insert(blk)
        self._add_reserved(mapped)
        self._note("segment_map", at, mapped)
        return True

    def _unmap_block(self, blk: _Block, pool: _Pool) -> None:
        """unmap_block(): unmap the whole pages inside a free block."""
        page = blk.segment.page_bytes
        base = blk.segment.base
        start = base + -(-(blk.addr - base) // page) * page
        end = base + ((blk.addr + blk.size - base) // page) * page
        if end <= start:
            return
        pool.erase(blk)
        if start > blk.addr:  # a partly used first page stays mapped and free
            before, blk = blk, blk.split(start - blk.addr)
            pool.insert(before)
        if blk.addr + blk.size > end:  # likewise the last page
            pool.insert(blk.split(end - blk.addr))
        blk.mapped = False
        self._try_merge(blk, blk.prev, pool)
        self._try_merge(blk, blk.next, pool)
        pool.insert_unmapped(blk)
        self.stats.reserved -= end - start
        self._note("segment_unmap", start, end - start)
        if not blk.is_split:  # release_expandable_segment()
            pool.erase_unmapped(blk)
            self.stats.segments.discard(blk.segment.base)

    # ------------------------------------------------------------ results
    def result(
        self,
        *,
        oom_event: int = -1,
        phase_allocated: dict | None = None,
        phase_reserved: dict | None = None,
        timeline: list[tuple[int, str, int, int]] | None = None,
    ) -> AllocatorResult:
        st = self.stats
        frag = 1.0 - st.allocated_at_peak_reserved / st.peak_reserved if st.peak_reserved else 0.0
        return AllocatorResult(
            peak_allocated_bytes=st.peak_allocated,
            peak_reserved_bytes=st.peak_reserved,
            peak_requested_bytes=st.peak_requested,
            reserved_at_end_bytes=st.reserved,
            fragmentation=frag,
            num_segments=len(st.segments),
            num_alloc_retries=st.num_alloc_retries,
            oom=oom_event >= 0,
            oom_event=oom_event,
            phase_allocated_bytes=dict(phase_allocated or {}),
            phase_reserved_bytes=dict(phase_reserved or {}),
            timeline=list(timeline or []),
        )


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division(): round up to the next of ``divisions``
    equal steps between the powers of two around ``size``."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    low = size & ~(step - 1)
    return size if low == size else low + step


def replay(
    events: Iterable[tuple[int, int, int]],
    config: AllocatorConfig | None = None,
    *,
    capacity_bytes: int | None = None,
    memory_fraction: float | None = None,
    device_memory_bytes: int | None = None,
    labels: Sequence[str] | None = None,
    timeline_points: int = 0,
    empty_cache_at: int | None = None,
) -> AllocatorResult:
    """Run an ordered alloc/free stream through the simulated allocator.

    Args:
        events: ``(+1 | -1, key, nbytes)`` in program order, as in
            :attr:`llmem_plugin.trace.tracker.TraceResult.events`; ``key`` pairs a
            free with its allocation.
        config: Parsed ``PYTORCH_CUDA_ALLOC_CONF`` (default settings if None).
        capacity_bytes: Bytes the allocator may reserve; None = unlimited.
        memory_fraction: See :class:`CachingAllocator`.
        device_memory_bytes: See :class:`CachingAllocator`.
        labels: A label per event (e.g. the training phase); the result then
            holds per-label peaks.
        timeline_points: When > 0, the result's ``timeline`` holds the
            allocated and reserved bytes after each event, thinned to about
            this many points (see :func:`_thin_timeline`).
        empty_cache_at: Before this event, ``torch.cuda.empty_cache()`` then
            ``torch.cuda.reset_peak_memory_stats()``: the peaks (per label too)
            are those from there on, as a job that resets them after loading
            reads them.

    Returns:
        The peaks; ``oom`` is set (and the replay stops) at the first request
        that does not fit.
    """
    alloc = CachingAllocator(
        config, capacity_bytes=capacity_bytes, memory_fraction=memory_fraction,
        device_memory_bytes=device_memory_bytes,
    )
    handles: dict[int, int] = {}
    st = alloc.stats
    ph_alloc: dict[str, int] = {}
    ph_res: dict[str, int] = {}
    points: list[tuple[int, str, int, int]] = []
    oom_event = -1
    for i, (sign, key, nbytes) in enumerate(events):
        lab = labels[i] if labels is not None else ""
        if i == empty_cache_at:
            alloc.empty_cache()
            alloc.reset_peaks()
            ph_alloc.clear()
            ph_res.clear()
        if sign > 0:
            if nbytes <= 0:  # zero-byte tensors get a null pointer, no block
                if timeline_points > 0:
                    points.append((i, lab, st.allocated, st.reserved))
                continue
            try:
                handles[key] = alloc.malloc(nbytes)
            except SimulatedOOM:
                oom_event = i
                break
        else:
            h = handles.pop(key, None)
            if h is not None:
                alloc.free(h)
        if labels is not None:
            if st.allocated > ph_alloc.get(lab, -1):
                ph_alloc[lab] = st.allocated
            ph_res[lab] = st.peak_reserved
        if timeline_points > 0:
            points.append((i, lab, st.allocated, st.reserved))
    timeline = _thin_timeline(points, timeline_points) if timeline_points > 0 else []
    return alloc.result(oom_event=oom_event, phase_allocated=ph_alloc, phase_reserved=ph_res, timeline=timeline)


def _thin_timeline(points: list[tuple[int, str, int, int]], n: int) -> list[tuple[int, str, int, int]]:
    """About ``n`` of ``points``, in order: the lowest and highest allocated
    point of each of ``n / 2`` equal runs of events (so a plot keeps every
    spike and dip), the first point of each label run (so phase boundaries
    are exact), the first and last points, and the first points where
    allocated and reserved reach their maxima."""
    if len(points) <= n:
        return list(points)
    keep = {0, len(points) - 1}
    keep.add(max(range(len(points)), key=lambda j: points[j][2]))
    keep.add(max(range(len(points)), key=lambda j: points[j][3]))
    starts = [j for j in range(1, len(points)) if points[j][1] != points[j - 1][1]]
    if len(starts) <= n:  # labels are phases: a handful of runs
        keep.update(starts)
    buckets = max(n // 2, 1)
    for b in range(buckets):
        lo, hi = b * len(points) // buckets, (b + 1) * len(points) // buckets
        if lo < hi:
            run = range(lo, hi)
            keep.add(min(run, key=lambda j: points[j][2]))
            keep.add(max(run, key=lambda j: points[j][2]))
    return [points[j] for j in sorted(keep)]
