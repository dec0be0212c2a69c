"""``PYTORCH_CUDA_ALLOC_CONF``, parsed as the CUDA caching allocator parses it.

Constants and option rules follow c10/cuda/CUDACachingAllocator.cpp and
c10/cuda/CUDAAllocatorConfig.{h,cpp} (torch 2.6; in 2.7+ the shared options
moved to c10/core/AllocatorConfig.{h,cpp} with the same names and defaults).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmem_plugin.device.versions import torch_minor
from llmem_plugin.errors import ConfigError

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "AllocatorConfig",
]

_MiB = 1024 * 1024
# CUDACachingAllocator.cpp (torch 2.6 - 2.13), namespace-level constants:
MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 * _MiB  # kSmallSize: largest "small" allocation is 1 MiB
SMALL_BUFFER = 2 * _MiB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
LARGE_BUFFER = 20 * _MiB  # kLargeBuffer: allocations between 1 and 10 MiB may use kLargeBuffer
MIN_LARGE_ALLOC = 10 * _MiB  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
ROUND_LARGE = 2 * _MiB  # kRoundLarge: round up large allocations to 2 MiB
# CUDAAllocatorConfig.h: kRoundUpPowerOfTwoIntervals = 16, the intervals
# [1 MiB, 2 MiB), ..., [32 GiB, 64 GiB) (sizes outside clamp to the ends).
_ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20  # 1 MiB

# Options that do not change device memory of the caching allocator (they
# concern the host pinned-memory allocator or lock behaviour); accepted, ignored.
_IGNORED = {
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
}
_KNOWN = {
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "backend",
} | _IGNORED


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Caching-allocator options that change how much memory is reserved.

    Attributes:
        max_split_size_bytes: Blocks at least this large are never split
            (``max_split_size_mb``); None = unlimited (the default).
        max_non_split_rounding_bytes: How much larger than an oversize request
            a cached oversize block may be and still be used
            (``max_non_split_rounding_mb``, default kLargeBuffer = 20 MiB).
        roundup_power2_divisions: Divisions per power-of-two interval, one per
            interval from [1 MiB, 2 MiB) to [32 GiB, 64 GiB); 0 or 1 = off.
        garbage_collection_threshold: Fraction of the memory-fraction cap above
            which old cached segments are freed (0 = off).
        expandable_segments: Grow one segment per pool by mapping pages.
        large_segment_bytes: Segment size for large-pool requests under
            10 MiB, and the page size of large expandable segments
            (kLargeBuffer, 20 MiB; ``large_segment_size_mb`` from torch 2.11,
            c10/core/AllocatorConfig.h ``large_segment_size_``).
        backend: ``native`` or ``cudaMallocAsync`` (the latter is not modelled).
        large_segments_descend: Not an option of ``PYTORCH_CUDA_ALLOC_CONF``:
            which of several equal-size free blocks a request takes, set by
            :meth:`for_torch` from the torch the job runs. Up to torch 2.11
            the free-block sets order by (stream, size, address)
            (``BlockComparatorSize``), and on a GPU each new large segment
            lies below the earlier ones, so a tie goes to the newest large
            segment; 2 MiB small-pool segments go the other way. From torch
            2.13 ties go to the oldest segment (pytorch#183591: a counter set
            at each cudaMalloc, ``BlockComparatorSizeCounterAddress``), as
            ascending addresses give. Reproduced on the stub device with torch
            2.11 and both address orders against the H200 rows
            (benchmarks/results/version-diff-h200-2026-12-06.md); the GPU's
            address order is inferred from those rows, not yet observed.
    """

    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * _ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_bytes: int = LARGE_BUFFER
    backend: str = "native"
    large_segments_descend: bool = False

    @property
    def max_split_bytes(self) -> int:
        """max_split_size with "unlimited" as a number (SIZE_MAX in the source)."""
        return self.max_split_size_bytes if self.max_split_size_bytes else 1 << 64

    def divisions_for(self, size: int) -> int:
        """CUDAAllocatorConfig::roundup_power2_divisions(size)."""
        log_size = size.bit_length() - 1
        index = max(log_size - _ROUNDUP_START_LOG2, 0)
        return self.roundup_power2_divisions[min(index, _ROUNDUP_INTERVALS - 1)]

    def to_env(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` string for these settings ("" = defaults)."""
        parts = []
        if self.max_split_size_bytes:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // _MiB}")
        if self.max_non_split_rounding_bytes != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // _MiB}")
        divs = self.roundup_power2_divisions
        if any(divs):
            if len(set(divs)) == 1:
                parts.append(f"roundup_power2_divisions:{divs[0]}")
            else:
                items = ",".join(f"{1 << i}:{d}" for i, d in enumerate(divs))
                parts.append(f"roundup_power2_divisions:[{items}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.large_segment_bytes != LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_bytes // _MiB}")
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        return ",".join(parts)

    def for_torch(self, torch_version: str | None) -> AllocatorConfig:
        """These settings as the allocator of ``torch_version`` (the installed torch if None) breaks
        ties between equal-size free blocks on a GPU (see ``large_segments_descend``). torch 2.12 was
        not measured: it is taken as 2.11, the release before the counter."""
        import dataclasses

        return dataclasses.replace(self, large_segments_descend=torch_minor(torch_version) < (2, 13))

    @classmethod
    def from_env(cls, text: str | None = None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string (the environment's if None).

        Raises:
            ConfigError: An option torch would reject, or one not modelled.
        """
        if text is None:
            text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        kw: dict = {}
        for key, value in _split_options(text):
            if key not in _KNOWN:
                raise ConfigError(
                    f"unknown PYTORCH_CUDA_ALLOC_CONF option '{key}'; valid: {', '.join(sorted(_KNOWN))}. "
                    "HINT: check the spelling (options are key:value, comma-separated)"
                )
            if key in _IGNORED:
                continue
            kw.update(_parse_option(key, value))
        return cls(**kw)


def _split_options(text: str) -> list[tuple[str, str]]:
    """Split "a:1,b:[x:1,y:2]" into [("a", "1"), ("b", "[x:1,y:2]")] (commas
    inside brackets belong to the value)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    out = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(
                f"cannot parse '{part}' in PYTORCH_CUDA_ALLOC_CONF '{text}'. "
                "HINT: use key:value pairs separated by commas, e.g. expandable_segments:True"
            )
        out.append((key.strip(), value.strip()))
    return out


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{value} is not an integer. HINT: e.g. {key}:512") from None


def _parse_option(key: str, value: str) -> dict:
    if key == "max_split_size_mb":
        mb = _int(key, value)
        # CUDAAllocatorConfig::parseMaxSplitSize: must exceed kLargeBuffer / 1 MiB.
        if mb <= LARGE_BUFFER // _MiB:
            raise ConfigError(
                f"max_split_size_mb:{mb} is too small; torch requires > {LARGE_BUFFER // _MiB}. HINT: e.g. 128"
            )
        return {"max_split_size_bytes": mb * _MiB}
    if key == "max_non_split_rounding_mb":
        mb = _int(key, value)
        # parseMaxNonSplitRoundingSize: must exceed kLargeBuffer / 1 MiB, like max_split_size_mb.
        if mb <= LARGE_BUFFER // _MiB:
            raise ConfigError(
                f"max_non_split_rounding_mb:{mb} is too small; torch requires > {LARGE_BUFFER // _MiB}. HINT: e.g. 64"
            )
        return {"max_non_split_rounding_bytes": mb * _MiB}
    if key == "large_segment_size_mb":
        mb = _int(key, value)
        if mb <= 0:
            raise ConfigError(f"large_segment_size_mb:{mb} must be a positive number of MiB. HINT: e.g. 20")
        return {"large_segment_bytes": mb * _MiB}
    if key == "garbage_collection_threshold":
        try:
            t = float(value)
        except ValueError:
            t = -1.0
        # parseGarbageCollectionThreshold: 0 < threshold < 1.
        if not 0.0 < t < 1.0:
            raise ConfigError(
                f"garbage_collection_threshold:{value} must be a number in (0, 1). HINT: e.g. 0.8"
            )
        return {"garbage_collection_threshold": t}
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise ConfigError(f"expandable_segments:{value} must be True or False. HINT: expandable_segments:True")
        return {"expandable_segments": value == "True"}
    if key == "backend":
        if value not in ("native", "cudaMallocAsync"):
            raise ConfigError(f"backend:{value} must be native or cudaMallocAsync. HINT: backend:native")
        return {"backend": value}
    assert key == "roundup_power2_divisions", key
    return {"roundup_power2_divisions": _parse_divisions(value)}


def _parse_divisions(value: str) -> tuple[int, ...]:
    """parseRoundUpPower2Divisions: one power of two for all sizes, or
    ``[size_mb:div, ..., >:div]``. In the list form the first entry also fills
    every interval below it, and ``>`` fills every interval above the last
    named one (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig::
    parseRoundUpPower2Divisions: std::fill from last_index + 1; checked
    against torch 2.13's allocator by benchmarks/stub_allocator.py). Older
    releases' CUDAAllocatorConfig.cpp (read in 2.6) filled from last_index,
    overwriting the last named interval too; that is not modelled. 0 turns
    rounding off for an interval."""
    divs = [0] * _ROUNDUP_INTERVALS

    def div_of(text: str, *, zero_ok: bool) -> int:
        d = _int("roundup_power2_divisions", text)
        if not (_is_pow2(d) or (zero_ok and d == 0)):
            raise ConfigError(f"roundup_power2_divisions {d} must be a power of 2. HINT: e.g. 4")
        return d

    if not value.startswith("["):
        return (div_of(value, zero_ok=False),) * _ROUNDUP_INTERVALS
    last, first = 0, True
    for item in filter(None, (s.strip() for s in value.strip("[]").split(","))):
        size_text, _, d_text = item.partition(":")
        d = div_of(d_text, zero_ok=True)
        if size_text.strip() == ">":
            divs[last + 1:] = [d] * (_ROUNDUP_INTERVALS - last - 1)
            continue
        mb = _int("roundup_power2_divisions", size_text)
        if not _is_pow2(mb):
            raise ConfigError(f"roundup_power2_divisions interval {mb} must be a power of 2. HINT: e.g. [256:1,>:4]")
        index = min(mb.bit_length() - 1, _ROUNDUP_INTERVALS - 1)
        if first:
            divs[:index] = [d] * index
            first = False
        divs[index] = d
        last = index
    return tuple(divs)
