"""What a training process takes from the card besides its tensors.

Two kinds, kept apart because they count against different things:

- **outside** PyTorch's caching allocator (:class:`OutsideMemory`): the CUDA context with
  the kernels loaded into it, and NCCL's communication buffers. ``memory_reserved()``
  never sees them, and the allocator cannot get them, so
  :func:`usable_bytes` ``= capacity_bytes - outside_bytes`` is what a step's reserved
  memory may reach.
- **workspaces** that go *through* the allocator (:class:`Workspaces`): the cuBLAS and
  cuBLASLt workspaces PyTorch allocates once per (handle, stream), cuDNN's per
  convolution. They are in ``memory_allocated()`` and ``memory_reserved()`` like any
  tensor, but remat's tracker (which sees tensors through the dispatcher) does not see
  them: they add to a step's peak, not to the outside.

Every term is an estimate with its source in a NOTE below, and every one can be replaced
by a measured figure. To measure yours after one training step:
``free, total = torch.cuda.mem_get_info(); total - free - torch.cuda.memory_reserved()``
is what this process (and any other on the card) holds outside the allocator.

This module is separate from :mod:`remat.devices` because it models a process, not a
card: the same H100 holds different outside bytes under TP=8 than alone.

NOTE [ CUDA context ]
    Rule. Each process that touches a card holds a CUDA context on it: driver state,
    per-thread stack reserve, and the code of every kernel loaded so far. PyTorch sets
    ``CUDA_MODULE_LOADING=LAZY`` unless the user set it (pytorch/pytorch#86509), so
    kernels load on first launch and the context grows during the first step.
    Measurements at creation, lazy loading: 287,047,680 B less a 20 MiB allocator
    block (~254 MiB, pytorch/pytorch#86509), ~300 MB (pytorch/pytorch#107667), ~400 MB
    (pytorch/pytorch#109888), 426 MiB on an RTX 6000 Ada with PyTorch 2.10 / CUDA 13.0
    (unslothai/unsloth-zoo#1053). A training step then loads its GEMM, attention,
    optimizer and NCCL kernels. remat's default, 512 MiB, rounds the largest
    measurement up for those kernels. With ``CUDA_MODULE_LOADING=EAGER`` every kernel
    of every loaded library is resident at once: 666,632,192 B for a minimal program
    (pytorch/pytorch#86509), ">1000 MB" for PyTorch's full set (pytorch/pytorch#107667);
    remat takes 1 GiB. The same default serves every card: the published measurements
    do not separate architectures. Override ``OutsideMemory(context_bytes=...)`` with
    your measurement.

NOTE [ NCCL buffers ]
    Rule. Each NCCL communicator a rank belongs to holds its own device buffers outside
    PyTorch's allocator; more communicators, more memory, linear in the number of
    channels (sjeaugey in NVIDIA/nccl#864, NVIDIA/nccl#986). remat's estimate per
    communicator of ``n >= 2`` ranks, on one rank::

        channels x 3 x (LL + LL128 + Simple)      # ring: 1 peer, tree: up to 2, per channel
        + nvls_channels x (4 x Simple + 2 MiB)     # NVLink SHARP, NVSwitch cards, n > 2
        + 32 MiB                                   # device-side structures

    with NCCL's default buffer sizes (``src/init.cc`` in NVIDIA/nccl): LL = 8 lines x
    512 threads x 8 steps x 16 B = 512 KiB (``NCCL_LL_BUFFSIZE``), LL128 = 120 x 640 x
    8 x 8 B = 4,915,200 B (``NCCL_LL128_BUFFSIZE``), Simple = 4 MiB (``NCCL_BUFFSIZE``),
    each overridable by its variable (bytes). Channels per card: two per NVLink, capped
    at NCCL's 32 (A100's 12 links: 24; H800's 8 links log "16 coll channels",
    NVIDIA/nccl#892; H100/H200/B200: 32), two over PCIe (L4, RTX 4090), then clamped by
    ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``. The NVLS term fits the log line of
    an 8xH200 communicator exactly ("buffSize 4194304 memSize 2097152 nvlsPerRankSize
    301989888" = 16 x (4 x 4 MiB + 2 MiB), vllm-project/vllm#9699; 16 channels,
    ``NCCL_NVLS_NCHANNELS``); ``NCCL_NVLS_ENABLE=0`` removes it. The 32 MiB calibrates
    the formula on the one published per-communicator measurement: 4 x A100 with NVLink,
    688 MiB for a group of more than two ranks (NVIDIA/nccl#964) against 693.5 MiB
    here. The same thread measured 544 MiB for a 2-rank group, which this formula puts
    at 693.5 MiB: 2-rank groups (a pipeline's neighbours) are overestimated, and NCCL
    >= 2.22 connects an algorithm only when first used, so a group that never runs
    tree collectives holds less. It is an upper-side estimate; measure and override
    ``OutsideMemory(nccl_bytes=...)`` where it matters.

    Which communicators a layout creates (:func:`layout_process_groups`): one per TP,
    DP/FSDP and PP group of more than one rank (``torch.distributed.pipelining``
    batches its sends and receives, which run on the PP group's communicator), plus
    the default (world) group when there are two or more parallel dimensions (a
    barrier, a logged all-reduce or ``init_process_group(device_id=...)`` builds it).
    Plain ``send``/``recv`` outside a batch builds one 2-rank communicator per peer
    instead: pass those sizes yourself.

NOTE [ cuBLAS workspaces ]
    Rule. PyTorch gives every (cuBLAS handle, stream) pair a workspace it allocates
    through its own caching allocator, and keeps it (``setWorkspaceForHandle`` in
    ``aten/src/ATen/cuda/CublasHandlePool.cpp``, pytorch/pytorch at 26a3905). Size:
    ``CUBLAS_WORKSPACE_CONFIG`` as ``:SIZE:COUNT`` pairs, SIZE in KiB, summed
    (``:4096:8`` = 32 MiB, ``:16:8`` = 128 KiB, ``:4096:2:16:8`` = 8 MiB + 128 KiB);
    unset, 32 MiB on compute capability 9.0 (H100, H200) and ``:4096:2:16:8`` =
    8,519,680 B on every other card (A100, L4, RTX 4090, B200). A value with no
    ``:SIZE:COUNT`` pair makes PyTorch warn and use the default; remat raises, since
    the user meant a size. cuBLASLt gets its own workspace per pair,
    ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), capped at the cuBLAS size unless
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``; with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``
    it uses the cuBLAS workspace and costs nothing more. Handles come from a per-thread
    pool, and autograd runs the backward of CUDA ops on its own device thread
    (``start_device_threads`` in ``torch/csrc/autograd/engine.h``), so a training step
    uses two handles (``threads=2``); each further stream that runs matmuls adds a
    pair per thread. cuDNN's convolution workspace is chosen per algorithm; a
    transformer runs no cuDNN convolution, so its default is 0; set
    ``Workspaces(cudnn_bytes=...)`` for a conv model, or ``CUDNN_CONV_WSCAP_DBG`` (MiB,
    PyTorch's cap on that workspace) is taken as the bound.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.devices import DeviceSpec, get_device
from remat.errors import message
from remat.units import format_bytes

__all__ = [
    "CONTEXT_EAGER_BYTES",
    "CONTEXT_LAZY_BYTES",
    "OutsideMemory",
    "Term",
    "Workspaces",
    "cublas_workspace_bytes",
    "format_terms",
    "layout_process_groups",
    "nccl_communicator_bytes",
    "outside_bytes",
    "outside_terms",
    "usable_bytes",
    "workspace_bytes",
    "workspace_terms",
]

_KIB = 1024
_MIB = 1024**2
_GIB = 1024**3

#: NOTE [ CUDA context ]
CONTEXT_LAZY_BYTES = 512 * _MIB
CONTEXT_EAGER_BYTES = 1 * _GIB

#: NCCL's default receive buffers per connection and protocol (NOTE [ NCCL buffers ]).
NCCL_LL_BYTES = 8 * 512 * 8 * 16
NCCL_LL128_BYTES = 120 * 640 * 8 * 8
NCCL_SIMPLE_BYTES = 4 * _MIB
_NCCL_CONNECTIONS_PER_CHANNEL = 3
_NCCL_NVLS_CHANNELS = 16
_NCCL_NVLS_MEM_BYTES = 2 * _MIB
_NCCL_FIXED_BYTES = 32 * _MIB
_NCCL_MAX_CHANNELS = 32
#: Coll channels per card and whether it sits on an NVSwitch with NVLink SHARP.
_NCCL_CARDS: dict[str, tuple[int, bool]] = {
    "a100-40gb": (24, False), "a100-80gb": (24, False),
    "h100-80gb": (32, True), "h200": (32, True), "b200": (32, True),
    "l4": (2, False), "rtx-4090": (2, False),
}

#: PyTorch's default cuBLAS workspace (NOTE [ cuBLAS workspaces ]).
CUBLAS_SM90_BYTES = 4096 * 8 * _KIB
CUBLAS_DEFAULT_BYTES = 4096 * _KIB * 2 + 16 * _KIB * 8
CUBLASLT_DEFAULT_BYTES = 1024 * _KIB
_CUBLAS_PAIR = re.compile(r":([0-9]+):([0-9]+)")


@dataclass(frozen=True)
class Term:
    """One item of a breakdown: its bytes and where the figure comes from.

    Args:
        size_bytes: the item's bytes.
        source: a short citation, or ``"override"`` / the variable that set it.
    """

    size_bytes: int
    source: str


def _check_bytes(owner: str, **values: int | None) -> None:
    for field, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(message(owner, f"{field} must be an int >= 0 (bytes) or None",
                                     {"found": repr(value)}, fix=f"pass {field}=<bytes>"))


@dataclass(frozen=True)
class OutsideMemory:
    """Overrides of the bytes a process holds on the card outside PyTorch's allocator.

    The defaults are estimates (NOTE [ CUDA context ], NOTE [ NCCL buffers ]); a
    measured figure is better: an override replaces its term whole.

    Args:
        context_bytes: CUDA context plus loaded kernels, bytes. Default: None (512 MiB
            under ``CUDA_MODULE_LOADING=LAZY``, PyTorch's default; 1 GiB under EAGER).
        nccl_bytes: every NCCL communicator of this rank together, bytes. Default: None
            (estimated from the process groups and NCCL's variables).
        other_bytes: anything else outside the allocator (another process on the card,
            a library with its own ``cudaMalloc``), bytes. Default: 0.

    Example:
        >>> OutsideMemory(context_bytes=600 * 2**20).context_bytes
        629145600
    """

    context_bytes: int | None = None
    nccl_bytes: int | None = None
    other_bytes: int = 0

    def __post_init__(self) -> None:
        _check_bytes("OutsideMemory", context_bytes=self.context_bytes,
                     nccl_bytes=self.nccl_bytes, other_bytes=self.other_bytes)


@dataclass(frozen=True)
class Workspaces:
    """Overrides of the library workspaces a step allocates through PyTorch's allocator.

    Args:
        cublas_bytes: cuBLAS workspace per (handle, stream), bytes. Default: None (from
            ``CUBLAS_WORKSPACE_CONFIG``, else PyTorch's default for the card).
        cublaslt_bytes: cuBLASLt workspace per (handle, stream), bytes. Default: None
            (from ``CUBLASLT_WORKSPACE_SIZE`` and ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``).
        cudnn_bytes: cuDNN convolution workspace, bytes. Default: None (0, or
            ``CUDNN_CONV_WSCAP_DBG`` MiB when set; a transformer runs no cuDNN conv).

    Example:
        >>> Workspaces(cudnn_bytes=256 * 2**20).cudnn_bytes
        268435456
    """

    cublas_bytes: int | None = None
    cublaslt_bytes: int | None = None
    cudnn_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_bytes("Workspaces", cublas_bytes=self.cublas_bytes,
                     cublaslt_bytes=self.cublaslt_bytes, cudnn_bytes=self.cudnn_bytes)


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _env_int(env: Mapping[str, str], name: str, api: str, *, minimum: int = 1) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(message(api, f"{name} is not an integer >= {minimum}",
                                 {name: repr(raw)}, fix=f"set {name} to an integer, or unset it"))
    return value


def _env_flag(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    return None


def layout_process_groups(*, tp: int = 1, dp: int = 1, pp: int = 1,
                          world_group: bool = True) -> tuple[int, ...]:
    """Sizes of the NCCL communicators one rank of a TP x DP x PP layout belongs to.

    One per parallel dimension of more than one rank, plus the default (world) group
    when there are two or more such dimensions (NOTE [ NCCL buffers ]).

    Args:
        tp: tensor-parallel degree. Default: 1.
        dp: data-parallel (DDP or FSDP) degree. Default: 1.
        pp: pipeline-parallel degree. Default: 1.
        world_group: count the default group as its own communicator when it differs
            from every parallel group. Default: True.

    Example:
        >>> layout_process_groups(tp=8, dp=4)
        (8, 4, 32)
        >>> layout_process_groups(dp=8)
        (8,)
    """
    for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(message("remat.device_memory.layout_process_groups",
                                     f"{name} must be an int >= 1", {name: repr(value)},
                                     fix=f"pass {name}=1 or more"))
    groups = tuple(size for size in (tp, dp, pp) if size > 1)
    if world_group and len(groups) >= 2:
        groups += (tp * dp * pp,)
    return groups


def nccl_communicator_bytes(spec: str | DeviceSpec, ranks: int,
                            env: Mapping[str, str] | None = None) -> int:
    """Estimated device bytes one NCCL communicator of ``ranks`` ranks holds on one rank.

    The formula and its sources: NOTE [ NCCL buffers ]. An upper-side estimate for
    2-rank groups; override with a measurement where it matters.

    Args:
        spec: the card (name or spec).
        ranks: ranks in the communicator; 1 or fewer hold nothing.
        env: NCCL's variables (``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``,
            ``NCCL_LL128_BUFFSIZE``, ``NCCL_MIN_NCHANNELS``, ``NCCL_MAX_NCHANNELS``,
            ``NCCL_NVLS_ENABLE``, ``NCCL_NVLS_NCHANNELS``). Default: None (``os.environ``).

    Example:
        >>> nccl_communicator_bytes("a100-80gb", 4, env={}) / 2**20
        693.5
    """
    api = "remat.device_memory.nccl_communicator_bytes"
    if ranks <= 1:
        return 0
    card = get_device(spec)
    e = _env(env)
    simple = _env_int(e, "NCCL_BUFFSIZE", api) or NCCL_SIMPLE_BYTES
    ll = _env_int(e, "NCCL_LL_BUFFSIZE", api) or NCCL_LL_BYTES
    ll128 = _env_int(e, "NCCL_LL128_BUFFSIZE", api) or NCCL_LL128_BYTES
    cc_major = card.compute_capability[0] if card.compute_capability else 9
    channels, nvswitch = _NCCL_CARDS.get(card.name, (_NCCL_MAX_CHANNELS, cc_major >= 9))
    channels = min(channels, _env_int(e, "NCCL_MAX_NCHANNELS", api) or channels)
    channels = max(channels, _env_int(e, "NCCL_MIN_NCHANNELS", api) or channels)
    total = channels * _NCCL_CONNECTIONS_PER_CHANNEL * (ll + ll128 + simple) + _NCCL_FIXED_BYTES
    if nvswitch and ranks > 2 and _env_flag(e, "NCCL_NVLS_ENABLE") is not False:
        nvls_channels = _env_int(e, "NCCL_NVLS_NCHANNELS", api) or _NCCL_NVLS_CHANNELS
        total += nvls_channels * (4 * simple + _NCCL_NVLS_MEM_BYTES)
    return total


def outside_terms(spec: str | DeviceSpec, outside: OutsideMemory | None = None, *,
                  env: Mapping[str, str] | None = None,
                  process_groups: Sequence[int] = ()) -> dict[str, Term]:
    """Itemized bytes a process holds on the card outside PyTorch's caching allocator.

    Args:
        spec: the card (name or spec).
        outside: overrides; a set field replaces its estimate. Default: None (estimates).
        env: environment to read (``CUDA_MODULE_LOADING`` and NCCL's variables).
            Default: None (``os.environ``).
        process_groups: sizes of the NCCL communicators this rank belongs to, e.g.
            ``layout_process_groups(tp=8, dp=4)``. Default: ``()`` (a single process).

    Returns:
        ``{"cuda_context": Term, "nccl": Term, "other": Term}``; the sizes sum to
        :func:`outside_bytes`.

    Example:
        >>> terms = outside_terms("h100-80gb", env={})
        >>> terms["cuda_context"].size_bytes == 512 * 2**20, terms["nccl"].size_bytes
        (True, 0)
    """
    out = outside or OutsideMemory()
    e = _env(env)
    if out.context_bytes is not None:
        context = Term(out.context_bytes, "override")
    elif e.get("CUDA_MODULE_LOADING", "").strip().upper() == "EAGER":
        context = Term(CONTEXT_EAGER_BYTES, "CUDA_MODULE_LOADING=EAGER: all kernels resident "
                                            "(pytorch/pytorch#86509, #107667)")
    else:
        context = Term(CONTEXT_LAZY_BYTES, "CUDA context, lazy kernel loading (PyTorch default; "
                                           "pytorch/pytorch#86509, #109888)")
    if out.nccl_bytes is not None:
        nccl = Term(out.nccl_bytes, "override")
    else:
        sizes = [int(n) for n in process_groups if n > 1]
        nccl = Term(sum(nccl_communicator_bytes(spec, n, e) for n in sizes),
                    f"NCCL buffers, {len(sizes)} communicator(s) of {sizes or 'no'} ranks "
                    "(estimate: NVIDIA/nccl src/init.cc, NVIDIA/nccl#964)")
    return {"cuda_context": context, "nccl": nccl,
            "other": Term(out.other_bytes, "override" if out.other_bytes else "none given")}


def outside_bytes(spec: str | DeviceSpec, outside: OutsideMemory | None = None, *,
                  env: Mapping[str, str] | None = None,
                  process_groups: Sequence[int] = ()) -> int:
    """Bytes a process holds on the card outside PyTorch's allocator: the sum of
    :func:`outside_terms` (same arguments).

    Example:
        >>> held = outside_bytes("l4", OutsideMemory(context_bytes=0), env={}, process_groups=(2,))
        >>> held / 2**20
        87.125
    """
    return sum(t.size_bytes for t in outside_terms(
        spec, outside, env=env, process_groups=process_groups).values())


def usable_bytes(spec: str | DeviceSpec, outside: OutsideMemory | None = None, *,
                 env: Mapping[str, str] | None = None,
                 process_groups: Sequence[int] = ()) -> int:
    """Bytes PyTorch's allocator can reserve: capacity less what is held outside it.

    The trade-off: the estimates are on the safe side (a fit judged on this is
    conservative by up to a few hundred MiB); measured overrides remove that.

    Args:
        spec: the card (name or spec); :func:`remat.devices.current` gives the exact one.
        outside, env, process_groups: as in :func:`outside_terms`.

    Raises:
        ValueError: the outside bytes leave nothing of the card.

    Example:
        >>> round(usable_bytes("h100-80gb", env={}) / 2**30, 3)
        78.605
    """
    card = get_device(spec)
    held = outside_bytes(card, outside, env=env, process_groups=process_groups)
    if held >= card.capacity_bytes:
        raise ValueError(message(
            "remat.device_memory.usable_bytes", "outside memory leaves nothing of the card",
            {"capacity": format_bytes(card.capacity_bytes), "outside": format_bytes(held)},
            fix="check the overrides and process groups passed"))
    return card.capacity_bytes - held


def cublas_workspace_bytes(spec: str | DeviceSpec, env: Mapping[str, str] | None = None) -> int:
    """PyTorch's cuBLAS workspace per (handle, stream), bytes (NOTE [ cuBLAS workspaces ]).

    Args:
        spec: the card; its compute capability picks PyTorch's default (32 MiB on 9.0,
            8 MiB + 128 KiB elsewhere, 32 MiB when unknown).
        env: environment with ``CUBLAS_WORKSPACE_CONFIG``. Default: None (``os.environ``).

    Raises:
        ValueError: ``CUBLAS_WORKSPACE_CONFIG`` is set but holds no ``:SIZE:COUNT`` pair.

    Example:
        >>> cublas_workspace_bytes("a100-80gb", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
        33554432
    """
    return _cublas(get_device(spec), _env(env), "remat.device_memory.cublas_workspace_bytes")[0]


def _cublas(card: DeviceSpec, env: Mapping[str, str], api: str) -> tuple[int, str]:
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is not None:
        pairs = _CUBLAS_PAIR.findall(config)
        if not pairs:
            raise ValueError(message(
                api, "CUBLAS_WORKSPACE_CONFIG holds no :SIZE:COUNT pair",
                {"CUBLAS_WORKSPACE_CONFIG": repr(config)},
                fix="set it as :SIZE_KiB:COUNT pairs, e.g. ':4096:8' or ':4096:2:16:8', "
                    "or unset it"))
        return (sum(int(size) * _KIB * int(count) for size, count in pairs),
                f"CUBLAS_WORKSPACE_CONFIG={config}")
    cc = card.compute_capability
    if cc is None:
        return CUBLAS_SM90_BYTES, "PyTorch default, largest (compute capability unknown)"
    if cc == (9, 0):
        return CUBLAS_SM90_BYTES, "PyTorch default on compute capability 9.0 (CublasHandlePool.cpp)"
    return CUBLAS_DEFAULT_BYTES, (f"PyTorch default :4096:2:16:8 on compute capability "
                                  f"{cc[0]}.{cc[1]} (CublasHandlePool.cpp)")


def workspace_terms(spec: str | DeviceSpec, workspaces: Workspaces | None = None, *,
                    env: Mapping[str, str] | None = None, streams: int = 1,
                    threads: int = 2) -> dict[str, Term]:
    """Itemized library workspaces a training step allocates through PyTorch's allocator.

    These count in ``memory_allocated()`` and ``memory_reserved()`` but not in what
    remat's tracker sees: add them to a step's peak (NOTE [ cuBLAS workspaces ]).

    Args:
        spec: the card (name or spec).
        workspaces: overrides; a set field replaces its estimate. Default: None.
        env: environment (``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``,
            ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, ``CUDNN_CONV_WSCAP_DBG``).
            Default: None (``os.environ``).
        streams: streams that run matmuls. Default: 1.
        threads: threads that run matmuls: the caller's and autograd's. Default: 2.

    Returns:
        ``{"cublas": Term, "cublaslt": Term, "cudnn": Term}``; sizes sum to
        :func:`workspace_bytes`.

    Example:
        >>> workspace_terms("h100-80gb", env={})["cublas"].size_bytes / 2**20
        64.0
    """
    api = "remat.device_memory.workspace_terms"
    card = get_device(spec)
    ws = workspaces or Workspaces()
    e = _env(env)
    for name, value in (("streams", streams), ("threads", threads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(message(api, f"{name} must be an int >= 1", {name: repr(value)},
                                     fix=f"pass {name}=1 or more"))
    pairs = streams * threads
    per_pair = f"x {pairs} (handle, stream) pairs"
    if ws.cublas_bytes is not None:
        cublas, cublas_src = ws.cublas_bytes, "override"
    else:
        cublas, cublas_src = _cublas(card, e, api)
    if ws.cublaslt_bytes is not None:
        lt, lt_src = ws.cublaslt_bytes, "override"
    else:
        unified = _env_flag(e, "TORCH_CUBLASLT_UNIFIED_WORKSPACE")
        size_kib = _env_int(e, "CUBLASLT_WORKSPACE_SIZE", api, minimum=0)
        lt = CUBLASLT_DEFAULT_BYTES if size_kib is None else size_kib * _KIB
        if unified is True:
            lt, lt_src = 0, "TORCH_CUBLASLT_UNIFIED_WORKSPACE=1: shares the cuBLAS workspace"
        elif unified is False:
            lt_src = "CUBLASLT_WORKSPACE_SIZE (KiB), not unified"
        else:
            lt, lt_src = min(lt, cublas), "CUBLASLT_WORKSPACE_SIZE (KiB, default 1024), capped"
    if ws.cudnn_bytes is not None:
        cudnn = Term(ws.cudnn_bytes, "override")
    elif (cap := _env_int(e, "CUDNN_CONV_WSCAP_DBG", api, minimum=0)) is not None:
        cudnn = Term(cap * _MIB, "CUDNN_CONV_WSCAP_DBG (MiB): the cap on cuDNN's workspace")
    else:
        cudnn = Term(0, "no cuDNN convolution assumed (transformers); set it for conv models")
    return {"cublas": Term(cublas * pairs, f"{cublas_src}, {per_pair}"),
            "cublaslt": Term(lt * pairs, f"{lt_src}, {per_pair}"),
            "cudnn": cudnn}


def workspace_bytes(spec: str | DeviceSpec, workspaces: Workspaces | None = None, *,
                    env: Mapping[str, str] | None = None, streams: int = 1,
                    threads: int = 2) -> int:
    """Library workspace bytes of a training step: the sum of :func:`workspace_terms`
    (same arguments).

    Example:
        >>> workspace_bytes("a100-80gb", env={}) == 2 * (8 * 2**20 + 128 * 2**10 + 2**20)
        True
    """
    return sum(t.size_bytes for t in workspace_terms(
        spec, workspaces, env=env, streams=streams, threads=threads).values())


def format_terms(terms: Mapping[str, Term]) -> str:
    """A breakdown as lines ``name: size (source)``, then the total, for tables and errors.

    Example:
        >>> print(format_terms({"nccl": Term(2**30, "estimate")}))
        nccl: 1.00 GiB (estimate)
        total: 1.00 GiB
    """
    lines = [f"{name}: {format_bytes(t.size_bytes)} ({t.source})" for name, t in terms.items()]
    lines.append(f"total: {format_bytes(sum(t.size_bytes for t in terms.values()))}")
    return "\n".join(lines)
