"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and its size rules.

What :class:`~remat.core.caching_allocator.CachingAllocatorModel` needs to know about a
job's allocator: the options torch 2.13 reads from the environment, parsed as torch parses
them, and the two size functions every request goes through (``round_size`` and
``get_allocation_size`` in ``c10/cuda/CUDACachingAllocator.cpp``).

NOTE [ Allocator settings as torch 2.13 reads them ]
    Rule 1. One variable is read, once, when CUDA is initialised: the first of
    ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF``
    that is set (``AcceleratorAllocatorConfig::instance()`` in
    ``c10/core/AllocatorConfig.cpp`` walks them in that order and parses the first
    found; ``CUDAAllocatorConfig::instance()`` does the same for the CUDA-only keys).
    Implication: setting both ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF``
    uses only the former, and a setting changed after CUDA started has no effect, which
    is why benchmarks/gpu_reserved.py runs each setting in its own process.

    Rule 2. The syntax is ``ConfigTokenizer``'s: ``key:value`` pairs separated by
    commas, whitespace ignored, a list value in brackets
    (``roundup_power2_divisions:[256:1,512:2,>:8]``). Booleans are exactly ``True`` or
    ``False``. A key neither the accelerator parser nor the CUDA parser knows is an
    error ("Unrecognized key"), as are the bounds ``parseArgs`` checks:
    ``large_segment_size_mb`` > 10 (``kMinLargeAlloc``), ``max_split_size_mb`` and
    ``max_non_split_rounding_mb`` >= ``large_segment_size_mb`` (20 by default),
    ``garbage_collection_threshold`` in (0, 1), divisions a power of two (or 0 in the
    list form), list boundaries powers of two. remat is stricter than ``std::stoull`` in
    one way: a number must be all digits (torch reads ``"128abc"`` as 128).

    Rule 3. ``roundup_power2_divisions`` holds one division count per power-of-two
    interval of request sizes, 16 intervals from 1 MiB up (``kRoundUpPowerOfTwoStart``,
    ``kRoundUpPowerOfTwoIntervals``): interval ``i`` holds ``[2^(20+i), 2^(21+i))``
    bytes, interval 0 also everything smaller, interval 15 everything larger. A single
    number sets all 16. In the list form ``N:d`` sets the interval of ``N`` MiB
    (``log2(N)``) to ``d``, the first entry also every interval below it, and ``>:d`` every
    interval after the last one named (``parseRoundUpPower2Divisions``).

    Rule 4. Keys the model has no use for (``backend:native``, ``release_lock_on_cudamalloc``,
    the ``pinned_*`` host-allocator keys, ...) are checked and ignored;
    ``backend:cudaMallocAsync`` is kept, and the model refuses it (a different allocator).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from remat.errors import message

_API = "AllocatorSettings"
_MIB = 1 << 20

#: ``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes.
MIN_BLOCK_BYTES = 512
#: ``kSmallSize``: the largest request the small pool serves, 1 MiB.
SMALL_SIZE_BYTES = 1 << 20
#: ``kSmallBuffer``: the small pool's segment (and expandable page) size, 2 MiB.
SMALL_BUFFER_BYTES = 2 << 20
#: ``kMinLargeAlloc``: large requests below 10 MiB share one ``large_segment_size`` segment.
MIN_LARGE_ALLOC_BYTES = 10 << 20
#: ``kRoundLarge``: larger requests get a segment of their size rounded up to 2 MiB.
ROUND_LARGE_BYTES = 2 << 20
#: ``kLargeBuffer``: the default ``large_segment_size``, 20 MiB.
LARGE_BUFFER_BYTES = 20 << 20
#: ``kRoundUpPowerOfTwoIntervals``: 1 MiB .. 64 GiB, one slot per power of two.
ROUNDUP_INTERVALS = 16

#: The environment variables torch 2.13 reads, in its order (NOTE [ Allocator settings as
#: torch 2.13 reads them ], Rule 1).
ENV_VARS: tuple[str, ...] = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
                             "PYTORCH_ALLOC_CONF")

_BOOL_KEYS = frozenset({
    "pinned_use_background_threads", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse", "pinned_free_catch_all", "throw_on_cudamalloc_oom"})
_SIZE_KEYS = frozenset({"pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                        "pinned_num_register_threads", "pinned_reserve_segment_size_mb"})
_MODELED_KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                 "garbage_collection_threshold", "roundup_power2_divisions",
                 "expandable_segments", "per_process_memory_fraction", "backend")
KNOWN_KEYS: tuple[str, ...] = tuple(sorted({*_MODELED_KEYS, *_BOOL_KEYS, *_SIZE_KEYS}))
_TOKEN = re.compile(r"[,:\[\]]|[^,:\[\]]+")
_DIGITS = re.compile(r"[0-9]+")


def _tokens(conf: str) -> list[str]:
    """``ConfigTokenizer``: separators are tokens of their own, whitespace is dropped."""
    return _TOKEN.findall("".join(conf.split()))


@dataclass(frozen=True)
class AllocatorSettings:
    """The options of PyTorch's CUDA caching allocator that change what it reserves.

    Built from a ``PYTORCH_CUDA_ALLOC_CONF`` string (:meth:`parse`), from the environment
    as torch reads it (:meth:`from_env`), or directly. The defaults are torch's: no
    expandable segments, every block may be split, no power-of-two rounding, no garbage
    collection. The trade-off the options make: splitting and packing small requests into
    shared segments saves ``cudaMalloc`` calls and memory, but a segment is returned to the
    device only when all of it is free, so a long step can reserve far more than it
    allocates (fragmentation); ``expandable_segments`` and ``max_split_size_mb`` trade
    speed for less of it.

    Args:
        expandable_segments: one segment per stream and pool that grows by pages
            (``expandable_segments:True``). Default: ``False``.
        max_split_size_bytes: blocks this large or larger are never split
            (``max_split_size_mb``), bytes; ``None`` for unlimited. Default: ``None``.
        max_non_split_rounding_bytes: how much larger than a request at or above
            ``max_split_size_bytes`` a cached unsplittable block may be and still serve it
            (``max_non_split_rounding_mb``), bytes; ``None`` for ``large_segment_size_bytes``.
            Default: ``None``.
        large_segment_size_bytes: the segment a 1-10 MiB request opens, and the large
            pool's expandable page (``large_segment_size_mb``), bytes. Default: 20 MiB.
        roundup_power2_divisions: division counts of the 16 size intervals (NOTE
            [ Allocator settings as torch 2.13 reads them ], Rule 3). Default: all 0.
        garbage_collection_threshold: the fraction of the allowed memory past which cached
            blocks are released before a new segment is opened (acts only with a memory
            fraction, as in torch). Default: 0 (off).
        per_process_memory_fraction: the share of the device the process may reserve
            (``per_process_memory_fraction``, or ``torch.cuda.set_per_process_memory_fraction``);
            ``None`` when not set. Default: ``None``.
        backend: ``"native"`` or ``"cudaMallocAsync"``. Default: ``"native"``.

    Example:
        >>> s = AllocatorSettings.parse("expandable_segments:True,max_split_size_mb:128")
        >>> s.expandable_segments, s.max_split_size_bytes // 2**20
        (True, 128)
        >>> s.conf
        'expandable_segments:True,max_split_size_mb:128'
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None
    max_non_split_rounding_bytes: int | None = None
    large_segment_size_bytes: int = LARGE_BUFFER_BYTES
    roundup_power2_divisions: tuple[int, ...] = field(
        default_factory=lambda: (0,) * ROUNDUP_INTERVALS)
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float | None = None
    backend: str = "native"

    def __post_init__(self) -> None:
        def bad(what: str, found: object, fix: str) -> ValueError:
            return ValueError(message(_API, what, {"found": found}, fix=fix))

        if self.large_segment_size_bytes <= MIN_LARGE_ALLOC_BYTES:
            raise bad("large_segment_size_bytes must be above 10 MiB (kMinLargeAlloc)",
                      self.large_segment_size_bytes, "pass more than 10 MiB")
        for name in ("max_split_size_bytes", "max_non_split_rounding_bytes"):
            value = getattr(self, name)
            if value is not None and value < self.large_segment_size_bytes:
                raise bad(f"{name} must be >= large_segment_size_bytes "
                          f"({self.large_segment_size_bytes} B)", value,
                          "pass at least the large segment size (20 MiB by default)")
        divisions = self.roundup_power2_divisions
        if len(divisions) != ROUNDUP_INTERVALS or any(
                d < 0 or (d & (d - 1)) for d in divisions):
            raise bad(f"roundup_power2_divisions must be {ROUNDUP_INTERVALS} powers of two "
                      "(or 0)", divisions, "build it with AllocatorSettings.parse("
                      "'roundup_power2_divisions:[256:1,>:4]')")
        gc = self.garbage_collection_threshold
        if not (gc == 0.0 or 0.0 < gc < 1.0):
            raise bad("garbage_collection_threshold must be in (0, 1), or 0 for off", gc,
                      "pass a fraction such as 0.8")
        fraction = self.per_process_memory_fraction
        if fraction is not None and not (0.0 <= fraction <= 1.0):
            raise bad("per_process_memory_fraction must be in [0, 1]", fraction,
                      "pass a fraction of the device, such as 0.9")
        if self.backend not in ("native", "cudaMallocAsync"):
            raise bad("unknown backend", repr(self.backend), "pass 'native' or 'cudaMallocAsync'")

    # ---- the size rules --------------------------------------------------------------------

    @property
    def max_split_bytes(self) -> int:
        """``max_split_size`` with "unlimited" as a number larger than any request."""
        return self.max_split_size_bytes if self.max_split_size_bytes is not None else 1 << 64

    @property
    def non_split_rounding_bytes(self) -> int:
        """``max_non_split_rounding_size``: ``large_segment_size`` unless set."""
        value = self.max_non_split_rounding_bytes
        return value if value is not None else self.large_segment_size_bytes

    def divisions_for(self, size_bytes: int) -> int:
        """``roundup_power2_divisions(size)``: the division count of ``size_bytes``'s
        interval (NOTE [ Allocator settings as torch 2.13 reads them ], Rule 3)."""
        index = min(max(size_bytes.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    def round_size(self, size_bytes: int) -> int:
        """``round_size``: the block size a request of ``size_bytes`` asks the pools for.

        At least 512 bytes (``kMinBlockSize``); with ``d > 1`` divisions for its interval
        and ``size_bytes > 512 * d``, the next of ``d`` equal steps between the powers of
        two around it (``roundup_power2_next_division``: 1200 B with 4 divisions is
        1280 B); else the next multiple of 512.

        Example:
            >>> AllocatorSettings().round_size(1)
            512
            >>> AllocatorSettings.parse("roundup_power2_divisions:4").round_size(5 << 20)
            5242880
            >>> AllocatorSettings.parse("roundup_power2_divisions:4").round_size(9 << 20) >> 20
            10
        """
        if size_bytes < MIN_BLOCK_BYTES:
            return MIN_BLOCK_BYTES
        divisions = self.divisions_for(size_bytes)
        if divisions > 1 and size_bytes > MIN_BLOCK_BYTES * divisions:
            if size_bytes & (size_bytes - 1) == 0:
                return size_bytes
            floor = 1 << (size_bytes.bit_length() - 1)
            step = floor >> (divisions.bit_length() - 1)
            if step == 0:
                return floor << 1
            rounded = size_bytes & ~(step - 1)
            return size_bytes if rounded == size_bytes else rounded + step
        return -(-size_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES

    def segment_size(self, block_bytes: int) -> int:
        """``get_allocation_size``: the segment a new ``cudaMalloc`` reserves for a block of
        ``block_bytes`` (already rounded): 2 MiB for the small pool (<= 1 MiB),
        ``large_segment_size`` (20 MiB) below 10 MiB, else rounded up to 2 MiB."""
        if block_bytes <= SMALL_SIZE_BYTES:
            return SMALL_BUFFER_BYTES
        if block_bytes < MIN_LARGE_ALLOC_BYTES:
            return self.large_segment_size_bytes
        return -(-block_bytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES

    # ---- parsing -----------------------------------------------------------------------

    @classmethod
    def parse(cls, conf: str) -> AllocatorSettings:
        """Settings from a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` value.

        Args:
            conf: ``key:value`` pairs separated by commas (NOTE [ Allocator settings as
                torch 2.13 reads them ], Rule 2); ``""`` gives the defaults.

        Raises:
            ValueError: an unknown key, a malformed value or one out of torch's bounds.

        Example:
            >>> AllocatorSettings.parse("roundup_power2_divisions:[256:1,>:4]").divisions_for(
            ...     1 << 30)
            4
        """
        if not isinstance(conf, str):
            raise TypeError(message(_API + ".parse", "conf must be a string",
                                    {"found": type(conf).__name__},
                                    fix="pass the text of PYTORCH_CUDA_ALLOC_CONF"))
        return _Parser(conf).settings()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllocatorSettings:
        """Settings from the environment, as torch 2.13 reads them at CUDA initialisation:
        the first of ``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF`` and
        ``PYTORCH_ALLOC_CONF`` that is set (NOTE [ Allocator settings as torch 2.13 reads
        them ], Rule 1).

        Args:
            environ: the variables. Default: ``os.environ``.

        Example:
            >>> AllocatorSettings.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
            ...     "PYTORCH_CUDA_ALLOC_CONF": ""}).expandable_segments
            False
        """
        if environ is None:
            import os

            environ = os.environ
        for var in ENV_VARS:
            if var in environ:
                try:
                    return cls.parse(environ[var])
                except ValueError as error:
                    raise ValueError(message(
                        f"{_API}.from_env", f"cannot read {var}",
                        {var: repr(environ[var]), "error": str(error)},
                        fix=f"fix or unset {var}")) from None
        return cls()

    @property
    def conf(self) -> str:
        """The settings as a ``PYTORCH_CUDA_ALLOC_CONF`` value (defaults left out)."""
        parts: list[str] = []
        if self.backend != "native":
            parts.append(f"backend:{self.backend}")
        if self.large_segment_size_bytes != LARGE_BUFFER_BYTES:
            parts.append(f"large_segment_size_mb:{self.large_segment_size_bytes // _MIB}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // _MIB}")
        if self.max_non_split_rounding_bytes is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // _MIB}")
        divisions = self.roundup_power2_divisions
        if len(set(divisions)) == 1 and divisions[0]:
            parts.append(f"roundup_power2_divisions:{divisions[0]}")
        elif any(divisions):
            pairs = ",".join(f"{1 << i}:{d}" for i, d in enumerate(self.roundup_power2_divisions))
            parts.append(f"roundup_power2_divisions:[{pairs}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction:g}")
        return ",".join(parts)


class _Parser:
    """``AcceleratorAllocatorConfig::parseArgs`` and ``CUDAAllocatorConfig::parseArgs`` over
    one string (NOTE [ Allocator settings as torch 2.13 reads them ])."""

    def __init__(self, conf: str) -> None:
        self.conf = conf
        self.tokens = _tokens(conf)
        self.values: dict[str, object] = {}

    def fail(self, what: str, fix: str, **facts: object) -> ValueError:
        return ValueError(message(_API + ".parse", what, {"conf": repr(self.conf), **facts},
                                  fix=fix))

    def token(self, i: int, what: str) -> str:
        if i >= len(self.tokens):
            raise self.fail(f"expected {what} at the end", "complete the last key:value pair")
        return self.tokens[i]

    def expect(self, i: int, sep: str) -> None:
        found = self.token(i, f"'{sep}'")
        if found != sep:
            raise self.fail(f"expected '{sep}', found {found!r}",
                            "write key:value pairs separated by commas")

    def number(self, i: int, key: str) -> int:
        text = self.token(i, f"a value for {key}")
        if not _DIGITS.fullmatch(text):
            raise self.fail(f"{key} must be a non-negative integer", "write digits only",
                            found=repr(text))
        return int(text)

    def boolean(self, i: int, key: str) -> bool:
        text = self.token(i, f"a value for {key}")
        if text not in ("True", "False"):
            raise self.fail(f"{key} must be True or False", "write True or False (capitalised)",
                            found=repr(text))
        return text == "True"

    def real(self, i: int, key: str) -> float:
        text = self.token(i, f"a value for {key}")
        try:
            value = float(text)
        except ValueError:
            raise self.fail(f"{key} must be a number", "write a decimal such as 0.8",
                            found=repr(text)) from None
        if not math.isfinite(value):
            raise self.fail(f"{key} must be finite", "write a decimal such as 0.8",
                            found=repr(text))
        return value

    def settings(self) -> AllocatorSettings:
        tokens = self.tokens
        large = LARGE_BUFFER_BYTES
        i = 0
        while i < len(tokens):  # large_segment_size_mb first: the others are bounded by it
            if tokens[i] == "large_segment_size_mb":
                self.expect(i + 1, ":")
                mb = self.number(i + 2, tokens[i])
                if mb <= MIN_LARGE_ALLOC_BYTES // _MIB:
                    raise self.fail("large_segment_size_mb must be > 10", "pass more than 10",
                                    found=mb)
                large = mb * _MIB
            i += 1
        fields: dict[str, object] = {"large_segment_size_bytes": large}
        i = 0
        while i < len(tokens):
            i = self.pair(i, fields, large)
            if i + 1 < len(tokens):
                self.expect(i + 1, ",")
                i += 1
            i += 1
        return AllocatorSettings(**fields)  # type: ignore[arg-type]

    def pair(self, i: int, fields: dict[str, object], large: int) -> int:
        """Parse the pair starting at token ``i`` into ``fields``; return its last index."""
        key = self.tokens[i]
        if key == "large_segment_size_mb":  # read by the first pass
            return i + 2
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            self.expect(i + 1, ":")
            mb = self.number(i + 2, key)
            if mb * _MIB < large:
                raise self.fail(f"{key} too small, must be >= {large // _MIB}",
                                f"pass at least {large // _MIB}", found=mb)
            name = "max_split_size_bytes" if key == "max_split_size_mb" \
                else "max_non_split_rounding_bytes"
            fields[name] = mb * _MIB
            return i + 2
        if key == "garbage_collection_threshold":
            self.expect(i + 1, ":")
            value = self.real(i + 2, key)
            if not 0.0 < value < 1.0:
                raise self.fail("garbage_collection_threshold must be in (0.0, 1.0)",
                                "pass a fraction such as 0.8", found=value)
            fields["garbage_collection_threshold"] = value
            return i + 2
        if key == "per_process_memory_fraction":
            self.expect(i + 1, ":")
            value = self.real(i + 2, key)
            if not 0.0 <= value <= 1.0:
                raise self.fail("per_process_memory_fraction must be in [0, 1]",
                                "pass a fraction of the device such as 0.9", found=value)
            fields["per_process_memory_fraction"] = value
            return i + 2
        if key == "expandable_segments":
            self.expect(i + 1, ":")
            fields["expandable_segments"] = self.boolean(i + 2, key)
            return i + 2
        if key == "roundup_power2_divisions":
            return self.divisions(i, fields)
        if key == "backend":
            self.expect(i + 1, ":")
            backend = self.token(i + 2, "a backend")
            if backend not in ("native", "cudaMallocAsync"):
                raise self.fail("unknown allocator backend", "pass native or cudaMallocAsync",
                                found=repr(backend))
            fields["backend"] = backend
            return i + 2
        if key in _BOOL_KEYS:
            self.expect(i + 1, ":")
            self.boolean(i + 2, key)
            return i + 2
        if key in _SIZE_KEYS:
            self.expect(i + 1, ":")
            self.number(i + 2, key)
            return i + 2
        raise self.fail(f"unrecognized key {key!r}", "use one of: " + ", ".join(KNOWN_KEYS))

    def divisions(self, i: int, fields: dict[str, object]) -> int:
        """``parseRoundUpPower2Divisions`` (NOTE [ Allocator settings as torch 2.13 reads
        them ], Rule 3)."""
        key = self.tokens[i]
        self.expect(i + 1, ":")
        i += 2
        if self.token(i, "a value for roundup_power2_divisions") != "[":
            value = self.number(i, key)
            if value == 0 or value & (value - 1):
                raise self.fail("roundup_power2_divisions must be a power of 2",
                                "pass 1, 2, 4, 8, ...", found=value)
            fields["roundup_power2_divisions"] = (value,) * ROUNDUP_INTERVALS
            return i
        slots = [0] * ROUNDUP_INTERVALS
        first, last = True, 0
        while i + 1 < len(self.tokens) and self.tokens[i + 1] != "]":
            i += 1
            boundary = self.tokens[i]
            self.expect(i + 1, ":")
            value = self.number(i + 2, key)
            i += 2
            if value & (value - 1):
                raise self.fail("roundup_power2_divisions must be powers of 2 or 0",
                                "pass 0, 1, 2, 4, 8, ...", found=value)
            if boundary == ">":
                slots[last + 1:] = [value] * (ROUNDUP_INTERVALS - last - 1)
            else:
                size_mb = self.number(i - 2, "a roundup interval")
                if size_mb == 0 or size_mb & (size_mb - 1):
                    raise self.fail("roundup intervals must be powers of 2 (MiB)",
                                    "pass 64, 128, 256, ...", found=size_mb)
                index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    slots[:index] = [value] * index
                    first = False
                slots[index] = value
                last = index
            if i + 1 < len(self.tokens) and self.tokens[i + 1] != "]":
                self.expect(i + 1, ",")
                i += 1
        if i + 1 >= len(self.tokens):
            raise self.fail("a list value is missing its ']'", "close the bracket")
        fields["roundup_power2_divisions"] = tuple(slots)
        return i + 1
