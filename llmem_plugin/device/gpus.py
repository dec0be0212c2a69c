"""The GPU catalog: memory, peak throughput and interconnect of common NVIDIA GPUs.

The figures live in ``device/gpus.json`` (package data, read once through
:mod:`importlib.resources`), one entry per GPU with the datasheet or
whitepaper each number comes from in its ``source`` field. Conventions, also
stated at the top of that file:

- ``memory_bytes`` is the nominal capacity, binary: an "80 GB" HBM part is
  ``80 * 2**30`` bytes. ``nvidia-smi`` reports a little less (81559 MiB on an
  H100 SXM) and ECC on GDDR parts reserves more (23034 MiB on an L4).
- ``*_tflops`` are dense peaks, never the 2:4-sparsity figures NVIDIA's
  datasheets headline. ``bf16_tflops``/``fp16_tflops`` are tensor-core rates
  with FP32 accumulate, which is what PyTorch's matmuls use; GeForce cards run
  FP16-accumulate at twice that rate, and that figure is not used.
  ``fp32_tflops`` is the non-tensor FP32 rate.
- ``memory_bandwidth_gbps`` and ``link_bandwidth_gbps`` are GB/s (10**9 bytes
  per second). ``link_bandwidth_gbps`` is per GPU and total bidirectional, as
  NVIDIA quotes it: NVLink4's 900 GB/s is 450 GB/s each way, PCIe Gen4 x16's
  64 GB/s is 32 GB/s each way.
- ``link`` is the card's usual intra-node GPU-to-GPU path: NVLink for SXM
  parts, PCIe for PCIe cards even where an optional 2-card NVLink bridge exists.

Names are matched case-insensitively, ignoring repeated whitespace and a
leading ``"NVIDIA "``, so the catalog key (``"h100-sxm"``), the device name
``torch.cuda.get_device_name()`` reports (``"NVIDIA H100 80GB HBM3"``) and any
listed alias all resolve to the same entry.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from decimal import Decimal
from importlib import resources
from typing import Any

from llmem_plugin.errors import ConfigError

__all__ = ["GPU", "get_gpu", "gpu_names", "host_memory_default", "match_device_name", "parse_memory", "resolve_gpu",
           "size_bytes"]

_HINT = "HINT: run 'llmem gpus' for the catalog"
_DEFAULT_GPU = "h100-sxm"
_NUM_SUGGESTIONS = 3  # at most this many "did you mean" names, as in the model catalog

# Compute capabilities each architecture ships with, from
# https://developer.nvidia.com/cuda-gpus (8.7 is Jetson Orin, listed for completeness).
_ARCH_COMPUTE_CAPABILITIES: dict[str, frozenset[tuple[int, int]]] = {
    "volta": frozenset({(7, 0), (7, 2)}),
    "ampere": frozenset({(8, 0), (8, 6), (8, 7)}),
    "ada": frozenset({(8, 9)}),
    "hopper": frozenset({(9, 0)}),
}

# Memory units parse_memory accepts: binary (IEC) and decimal (SI) prefixes.
_MEMORY_UNITS = {
    "tib": 2**40,
    "gib": 2**30,
    "mib": 2**20,
    "tb": 10**12,
    "gb": 10**9,
    "mb": 10**6,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_MEMORY_FORMS = "80GiB, 80GB (10^9 bytes), 81920MiB, or a plain number of GiB such as 80"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU model: its memory, peak throughput and interconnect.

    Attributes:
        name: Catalog key, lowercase (``"h100-sxm"``).
        display_name: The device name ``torch.cuda.get_device_name()`` reports.
        aliases: Other accepted spellings, including other drivers' device names.
        memory_bytes: Nominal memory capacity in bytes (binary: 80 GB = 80 * 2**30).
        driver_memory_bytes: Total the driver reports (``nvidia-smi``
            memory.total), where a source quotes it; None otherwise.
        architecture: ``"volta"``, ``"ampere"``, ``"ada"`` or ``"hopper"``.
        compute_capability: CUDA compute capability as ``(major, minor)``.
        num_sms: Streaming multiprocessors (kernel choices such as flash
            attention's split-KV depend on it).
        bf16_tflops: Dense BF16 tensor-core TFLOP/s with FP32 accumulate, or
            ``None`` where the GPU has no BF16 tensor cores (Volta).
        fp16_tflops: Dense FP16 tensor-core TFLOP/s with FP32 accumulate.
        fp32_tflops: Dense non-tensor FP32 TFLOP/s.
        memory_bandwidth_gbps: Peak memory bandwidth in GB/s (10**9 bytes/s).
        link: Usual intra-node interconnect (``"nvlink4"``, ``"pcie4"``, ...).
        link_bandwidth_gbps: That link's GB/s per GPU, total bidirectional.
        pcie: Host interface (``"pcie5 x16"``).
        source: Where the figures come from, and which of them are uncertain.

    Known limitations:
        Peaks are datasheet figures at boost clock; sustained matmul throughput
        is lower, and power-capped cards (L4, A10G) fall further short.
    """

    name: str
    display_name: str
    aliases: tuple[str, ...]
    memory_bytes: int
    driver_memory_bytes: int | None
    architecture: str
    compute_capability: tuple[int, int]
    num_sms: int
    bf16_tflops: float | None
    fp16_tflops: float
    fp32_tflops: float
    memory_bandwidth_gbps: float
    link: str
    link_bandwidth_gbps: float
    pcie: str
    source: str

    def __post_init__(self) -> None:
        if self.name != self.name.strip().lower() or not self.name:
            raise ValueError(f"GPU name {self.name!r} must be non-empty and lowercase")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ValueError(f"GPU {self.name!r}: memory_bytes must be a positive int, got {self.memory_bytes!r}")
        valid_cc = _ARCH_COMPUTE_CAPABILITIES.get(self.architecture)
        if valid_cc is None:
            raise ValueError(
                f"GPU {self.name!r}: unknown architecture {self.architecture!r}; "
                f"valid: {', '.join(_ARCH_COMPUTE_CAPABILITIES)}"
            )
        if tuple(self.compute_capability) not in valid_cc:
            raise ValueError(
                f"GPU {self.name!r}: compute capability {self.compute_capability!r} is not {self.architecture}'s"
            )
        rates = {
            "fp16_tflops": self.fp16_tflops,
            "fp32_tflops": self.fp32_tflops,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "link_bandwidth_gbps": self.link_bandwidth_gbps,
        }
        if self.bf16_tflops is not None:
            rates["bf16_tflops"] = self.bf16_tflops
        for field, value in rates.items():
            if not value > 0:
                raise ValueError(f"GPU {self.name!r}: {field} must be positive, got {value!r}")
        if not self.source:
            raise ValueError(f"GPU {self.name!r} gives no source for its figures")

    @property
    def capacity_bytes(self) -> int:
        """Memory a job can use: the driver-reported total where known, else nominal."""
        return self.driver_memory_bytes or self.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        """Return the GPU as plain JSON-serialisable data."""
        d = dataclasses.asdict(self)
        d["aliases"] = list(self.aliases)
        d["compute_capability"] = list(self.compute_capability)
        return d


def _normalize(name: str) -> str:
    """Lowercase, collapse whitespace, drop a leading ``"nvidia "``."""
    key = " ".join(name.split()).lower()
    return key.removeprefix("nvidia ")


@functools.cache
def _catalog() -> dict[str, GPU]:
    path = resources.files("llmem_plugin.device").joinpath("gpus.json")
    raw = json.loads(path.read_text(encoding="utf-8"))
    gpus: dict[str, GPU] = {}
    for name, e in raw["gpus"].items():
        bf16 = e["bf16_tflops"]
        gpus[name] = GPU(
            name=name,
            display_name=e["display_name"],
            aliases=tuple(e["aliases"]),
            memory_bytes=e["memory_bytes"],
            driver_memory_bytes=e["driver_memory_bytes"],
            architecture=e["architecture"],
            compute_capability=(e["compute_capability"][0], e["compute_capability"][1]),
            num_sms=e["num_sms"],
            bf16_tflops=None if bf16 is None else float(bf16),
            fp16_tflops=float(e["fp16_tflops"]),
            fp32_tflops=float(e["fp32_tflops"]),
            memory_bandwidth_gbps=float(e["memory_bandwidth_gbps"]),
            link=e["link"],
            link_bandwidth_gbps=float(e["link_bandwidth_gbps"]),
            pcie=e["pcie"],
            source=e["source"],
        )
    return gpus


@functools.cache
def _keys() -> dict[str, str]:
    """Normalized name, device name and alias -> catalog name."""
    keys: dict[str, str] = {}
    for name, gpu in _catalog().items():
        for key in (name, gpu.display_name, *gpu.aliases):
            other = keys.setdefault(_normalize(key), name)
            assert other == name, f"GPU key {key!r} names both {other!r} and {name!r}"
    return keys


def gpu_names() -> list[str]:
    """List the catalog's GPU names.

    Returns:
        The catalog keys, sorted.
    """
    return sorted(_catalog())


def match_device_name(device_name: str) -> GPU | None:
    """Find the catalog entry of a device name reported by torch or NVML.

    This is a lookup for names a machine reports (measured benchmark rows,
    ``torch.cuda.get_device_name()``), not for user input, so a miss is
    ``None`` rather than an error; user input goes through :func:`get_gpu`.

    Args:
        device_name: E.g. ``"NVIDIA A100-SXM4-80GB"`` or ``"Tesla V100-SXM2-16GB"``;
            a catalog key or alias matches too.

    Returns:
        The matching :class:`GPU`, or ``None`` if no entry has that name.
    """
    name = _keys().get(_normalize(device_name))
    return None if name is None else _catalog()[name]


def get_gpu(name: str) -> GPU:
    """Return a catalog GPU by key, device name or alias (case-insensitive).

    Args:
        name: E.g. ``"h100-sxm"``, ``"NVIDIA H100 80GB HBM3"`` or ``"rtx4090"``.

    Returns:
        The :class:`GPU`.

    Raises:
        ConfigError: ``name`` is not in the catalog; the message lists the valid names.
    """
    if not isinstance(name, str):
        raise ConfigError(f"GPU name {name!r} is not a string. HINT: e.g. 'h100-sxm'; run 'llmem gpus' for the catalog")
    gpu = match_device_name(name)
    if gpu is not None:
        return gpu
    candidates = _spelling_candidates(name)
    if len(candidates) == 1:
        return _catalog()[candidates[0]]
    if candidates:
        raise ConfigError(
            f"GPU {name!r} is ambiguous: it names {', '.join(candidates)}. HINT: pass one of them, e.g. "
            f"{candidates[0]}; run 'llmem gpus' for the catalog"
        )
    raise ConfigError(f"unknown GPU {name!r}{_did_you_mean(name)} valid: {', '.join(gpu_names())}. {_HINT}")


# Words a GPU name may carry that name no particular model.
_NOISE_WORDS = frozenset({"nvidia", "geforce", "tesla"})


def _words(name: str) -> frozenset[str]:
    """The words of a GPU name, lowercase, split at anything not a letter or
    digit; a memory size written "40g" reads as "40gb"."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    return frozenset(re.sub(r"^(\d+)g$", r"\1gb", w) for w in words if w and w not in _NOISE_WORDS)


@functools.cache
def _catalog_words() -> dict[str, frozenset[str]]:
    """Catalog name -> every word of its key, device name and aliases."""
    return {
        name: frozenset().union(*(_words(k) for k in (name, gpu.display_name, *gpu.aliases)))
        for name, gpu in _catalog().items()
    }


def _spelling_candidates(name: str) -> list[str]:
    """Catalog entries whose words include every word of ``name`` ("A100 40GB",
    "a100-40g", "RTX 4090" each name one; "H100" names two)."""
    words = _words(name)
    if not words:
        return []
    return sorted(n for n, ws in _catalog_words().items() if words <= ws)


def _did_you_mean(name: str) -> str:
    # A family prefix ("h100", "a100") names several entries; otherwise take
    # difflib's close matches (its default cutoff, 0.6) among all keys.
    key = _normalize(name)
    suggestions = [n for n in gpu_names() if key and n.startswith(key)]
    if not suggestions:
        keys = _keys()
        for match in difflib.get_close_matches(key, keys, n=len(keys)):
            if keys[match] not in suggestions:
                suggestions.append(keys[match])
    suggestions = suggestions[:_NUM_SUGGESTIONS]
    return f"; did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ";"


def parse_memory(text: str, *, what: str = "GPU memory") -> int:
    """Parse a GPU memory size into bytes.

    ``GiB``/``MiB``/``TiB`` are binary (2**30, 2**20, 2**40 bytes) and
    ``GB``/``MB``/``TB`` decimal (10**9, 10**6, 10**12 bytes), as the units
    say: ``"40GB"`` is 40 * 10**9 bytes, about 37.25 GiB. A bare number is
    GiB. Units are case-insensitive and may follow a space; fractional
    amounts round to the nearest byte.

    Args:
        text: E.g. ``"80GiB"``, ``"80GB"``, ``"81920MiB"`` or ``"80"``.
        what: What the size is, for messages.

    Returns:
        The size in bytes, positive.

    Raises:
        ConfigError: ``text`` is not one of the accepted forms, or is zero.
    """
    match = _MEMORY_RE.match(str(text))
    number, suffix = match.groups() if match else ("", "")
    unit = _MEMORY_UNITS.get(suffix.lower()) if suffix else 2**30  # a bare number is GiB
    if match is None or unit is None:
        raise ConfigError(f"{what} {text!r} not understood; accepted forms: {_MEMORY_FORMS}. HINT: e.g. 80GiB")
    # Decimal, not float, so "0.1GB" is exactly 10**8 bytes.
    nbytes = int((Decimal(number) * unit).to_integral_value())
    if nbytes <= 0:
        raise ConfigError(f"{what} {text!r} must be positive. HINT: e.g. 80GiB")
    return nbytes


def resolve_gpu(name: str | None, memory: str | None, *, default: str = _DEFAULT_GPU) -> GPU:
    """Resolve the GPU a command targets, with an optional memory override.

    Args:
        name: Catalog key, device name or alias; ``None`` selects ``default``.
        memory: A ``--gpu-memory`` value for :func:`parse_memory`, or ``None``
            to keep the catalog capacity. It replaces only ``memory_bytes``
            (e.g. to model memory another process holds, or a MIG slice).
        default: The GPU used when ``name`` is ``None``.

    Returns:
        The catalog :class:`GPU`, with ``memory_bytes`` overridden if ``memory`` was given.

    Raises:
        ConfigError: The name is not in the catalog, or ``memory`` cannot be parsed.
    """
    gpu = get_gpu(default if name is None else name)
    if memory is not None:
        gpu = dataclasses.replace(gpu, memory_bytes=parse_memory(memory), driver_memory_bytes=None)
    return gpu


# ----------------------------------------------------------------- host RAM defaults
@functools.cache
def _host_memory_catalog() -> dict[str, dict[str, Any]]:
    path = resources.files("llmem_plugin.device").joinpath("gpus.json")
    return json.loads(path.read_text(encoding="utf-8"))["host_memory"]["gpus"]


def host_memory_default(name: str, gpus_per_node: int) -> tuple[int, str]:
    """Host RAM of a node of ``gpus_per_node`` catalog GPUs when none is given:
    the cloud instance ``device/gpus.json`` lists for that GPU count (rule in
    its ``host_memory.units``).

    Args:
        name: Catalog GPU name (or any spelling :func:`get_gpu` takes).
        gpus_per_node: GPUs on the node, at least 1.

    Returns:
        (bytes, where the figure comes from: the instance and its provider page).
    """
    key = get_gpu(name).name
    entry = _host_memory_catalog()[key]
    n = max(int(gpus_per_node), 1)
    rows = sorted(entry["instances"], key=lambda r: r[0])
    fit = next((r for r in rows if r[0] >= n), rows[-1])
    gpus, nbytes, instance, url = fit
    ref = url or entry["host_memory_source"]  # the provider page, else the note (an assumption)
    if gpus == n:
        return nbytes, f"{instance}, catalog default for {n} x {key}: {ref}"
    share = nbytes * n // gpus
    return share, f"{n}/{gpus} of {instance}'s {nbytes / 2**30:g} GiB, catalog default for {n} x {key}: {ref}"


# A size given as a bare int below this is refused: no GPU or host has less
# than 1 MiB, so ``80`` almost surely means 80 GiB, not 80 bytes.
_MIN_SIZE_BYTES = 2**20


def size_bytes(value: int | str, *, name: str, what: str, example: str) -> int:
    """A memory size from the Python API: an int of bytes or a size string.

    Args:
        value: Bytes (an int of at least 1 MiB) or a size with its unit as
            :func:`parse_memory` reads it (a bare number in a string is GiB).
        name: The argument, for messages (``gpu_memory``, ``host_memory``).
        what: What the size is, for messages ("GPU memory", "host memory").
        example: A size to suggest (``"80GiB"``).

    Raises:
        ConfigError: Another type, a size that does not parse, a size that is
            not positive, or an int below 1 MiB (almost surely meant in GiB).
    """
    if isinstance(value, str):
        return parse_memory(value, what=what)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be bytes (an int) or a size string, got {type(value).__name__} {value!r}. "
                          f"HINT: {name}='{example}'")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive number of bytes, got {value!r}. HINT: {name}='{example}'")
    if value < _MIN_SIZE_BYTES:
        raise ConfigError(f"{name}={value} is read as {value} bytes, below 1 MiB; a bare number is bytes. "
                          f"HINT: pass {name}='{value}GiB' (or {value} * 2**30)")
    return value
