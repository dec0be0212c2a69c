"""The largest micro-batch, or the longest sequence, whose step fits a GPU, without running out of memory once.

:func:`max_batch_size` and :func:`max_seq_len` estimate the job (as
:func:`llmem_plugin.estimate`, or one distributed method's worst rank as
:func:`llmem_plugin.methods.estimate_method`, or a run of variable-length
steps as :func:`llmem_plugin.techniques.varlen.estimate_variable_length`) at a
few values and search for the largest that fits the capacity less a headroom.

How the search is cheap: memory grows in pieces with the value (affine in
the batch at a fixed shape; in the length, affine with flash/efficient
attention and quadratic with eager attention), so the value where the need
meets the limit is predicted from the points already estimated (a line
through the last two fitting points; between a fitting and a failing point,
the chord, with a halving step whenever the chord keeps landing on one side).
Only the two values either side of the answer decide it, and both are
estimated on the exact path: one GPU's default path is the full trace's
figures (its built stream is proven equal, :mod:`llmem_plugin.trace.fastsynth`);
a method's bracket is found with its fast mode (per-layer extrapolation) and
then confirmed, and if need be moved, with the full trace's figures
(``stream_synthesis``). A fast probe never decides the answer.

The search assumes the verdict changes once over the range: a step that fits
at a value fits at every smaller value. The caching allocator's reserved peak
can break that by a block or two near the limit; the answer is the largest
value that fits with the next value up refused, and both are in the report.

Known limitations:
    * Host RAM is reported by ``estimate`` and ``plan``, not searched here:
      the batch and the length do not change the states offloaded to the host.
    * The pipeline methods search the micro-batch each of their microbatches
      carries (``--batch-size``), not the number of microbatches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmem_plugin.errors import ConfigError, WontFitError

__all__ = [
    "DEFAULT_HEADROOM",
    "MaxPoint",
    "MaxResult",
    "context_length",
    "headroom_bytes",
    "max_batch_size",
    "max_batch_table",
    "max_seq_len",
]

# The default headroom: the largest device-total error the project's targets
# allow (docs/accuracy.md: 3% on one GPU; docs/methods.md: 4% on any rank of a
# distributed run), so that an estimate at the edge of its target still fits.
DEFAULT_HEADROOM = 0.04
# The largest micro-batch searched unless ``limit`` says otherwise: far past any
# LLM fine-tuning batch, and it keeps a tiny model's search to ~17 doublings.
DEFAULT_BATCH_LIMIT = 1 << 16
# The longest sequence searched for a model that names no context length: the
# most tokens per micro-batch the CLI models (llmem_plugin/cli/options.py, _MAX_TOKENS).
DEFAULT_SEQ_LIMIT = 1 << 24
_WHAT = {"batch_size": ("micro_batch_size", "--batch-size"), "seq_len": ("seq_len", "--seq-len")}


@dataclass(frozen=True, kw_only=True)
class MaxPoint:
    """The job estimated at one value.

    Attributes:
        value: The micro-batch size or sequence length.
        device_total_bytes: The (worst rank's) device total at this value.
        peak_allocated_bytes, peak_reserved_bytes: The allocator's peaks.
        fits: Whether the step runs within the limit (the simulated allocator's
            free-and-retry included, as torch does).
        exact: The full trace's figures (else a fast-mode extrapolation used
            only to bracket the answer).
        rank: The worst rank (0 on one GPU).
    """

    value: int
    device_total_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fits: bool
    exact: bool
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class MaxResult:
    """The largest value of ``what`` whose step fits, and the points the search estimated.

    Attributes:
        what: ``batch_size`` or ``seq_len``.
        value: The largest value that fits (at least the first value searched).
        next_value: The next value up, which does not fit; None when the search
            stopped at ``limit`` (``capped_by`` says why).
        capped_by: Why no larger value was searched, or None.
        gpu: The catalog GPU.
        capacity_bytes: The GPU's capacity.
        headroom_bytes: What is kept free.
        limit_bytes: ``capacity_bytes - headroom_bytes``: what the device total must fit.
        method: The distributed method (``single`` on one GPU).
        num_gpus: The world size.
        fixed: The other workload value (the sequence length when the batch is
            searched, and the reverse).
        multiple_of: Only multiples of this were searched.
        points: Every value estimated, ascending, exact points after fast ones of the same value.
        seconds: Wall time of the search.
    """

    what: str
    value: int
    next_value: int | None
    capped_by: str | None
    gpu: str
    capacity_bytes: int
    headroom_bytes: int
    limit_bytes: int
    method: str
    num_gpus: int
    fixed: int
    multiple_of: int
    points: tuple[MaxPoint, ...]
    seconds: float

    @property
    def answer(self) -> MaxPoint | None:
        """The exact point at :attr:`value` (None when nothing fits)."""
        return next((p for p in self.points if p.value == self.value and p.exact), None)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["points"] = [p.to_dict() for p in self.points]
        return d


def headroom_bytes(headroom: float | int | str, capacity_bytes: int) -> int:
    """What ``headroom`` keeps free of ``capacity_bytes``.

    Args:
        headroom: A fraction of the capacity (a float from 0 up to, not
            including, 1, or its spelling: ``"0.05"``, ``"5e-2"``), 0, or a
            size (bytes as an int of at least 1 MiB, or a string with its
            unit, ``"2GiB"``). A bare number from 1 up is refused as ambiguous.

    Raises:
        ConfigError: A fraction outside [0, 1), a size that does not parse,
            or a headroom that leaves no memory.
    """
    from llmem_plugin.device.gpus import parse_memory

    hint = "HINT: pass a fraction of the GPU's memory (0.05) or a size with its unit (2GiB)"
    if isinstance(headroom, bool):
        raise ConfigError(f"headroom {headroom!r} is neither a fraction nor a size. {hint}")
    if isinstance(headroom, str):
        try:
            value = float(headroom)
        except ValueError:
            value = None
        if value is None:
            try:
                out = parse_memory(headroom, what="headroom")
            except ConfigError:
                raise ConfigError(f"headroom {headroom!r} is neither a fraction nor a size. {hint}") from None
        elif value < 1.0:
            return headroom_bytes(value, capacity_bytes)
        else:
            raise ConfigError(f"headroom {headroom!r} has no unit: a fraction is below 1, a size names its unit. "
                              f"{hint}")
    elif isinstance(headroom, float) or headroom == 0:
        if not 0.0 <= headroom < 1.0:
            raise ConfigError(f"headroom {headroom!r} as a fraction must be from 0 up to 1 (of the GPU's memory). "
                              f"{hint}")
        out = int(headroom * capacity_bytes)
    elif isinstance(headroom, int) and headroom >= 2**20:
        out = headroom
    else:
        raise ConfigError(f"headroom {headroom!r} is neither a fraction nor a size (an int is bytes, at least 1 MiB). "
                          f"{hint}")
    if out >= capacity_bytes:
        raise ConfigError(f"headroom {headroom} leaves nothing of the GPU's {capacity_bytes / 2**30:.1f} GiB. "
                          "HINT: pass a smaller --headroom (a fraction such as 0.05, or a size such as 2GiB)")
    return out


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What every probe estimates, less the value searched."""

    model: Any
    workload: Any
    gpu: Any  # the catalog GPU with the limit as its capacity
    method: str
    layout: Any
    options: dict[str, Any]
    lengths: Any
    steps: int | None
    alloc_conf: Any
    torch_version: str | None

    def at(self, what: str, value: int, *, exact: bool) -> MaxPoint:
        """The job estimated with ``what`` set to ``value``."""
        field = _WHAT[what][0]
        wl = dataclasses.replace(self.workload, **{field: value})
        if self.lengths is not None:
            from llmem_plugin.techniques.varlen import estimate_variable_length

            v = estimate_variable_length(self.model, wl, self.lengths, steps=self.steps, gpu=self.gpu,
                                         alloc_conf=self.alloc_conf, torch_version=self.torch_version)
            return MaxPoint(value=value, device_total_bytes=v.device_total_bytes,
                            peak_allocated_bytes=v.peak_allocated_bytes, peak_reserved_bytes=v.peak_reserved_bytes,
                            fits=v.fits, exact=True)
        if self.method == "single":
            from llmem_plugin.estimate import estimate

            e = estimate(self.model, wl, gpu=self.gpu, alloc_conf=self.alloc_conf, torch_version=self.torch_version)
            return MaxPoint(value=value, device_total_bytes=e.device_total_bytes,
                            peak_allocated_bytes=e.peak_allocated_bytes, peak_reserved_bytes=e.peak_reserved_bytes,
                            fits=e.fits, exact=e.trace_path != "extrapolated")
        from llmem_plugin.methods import estimate_method

        kw = dict(self.options)
        if self.method.startswith("pp"):
            kw["fast"] = not exact
        elif exact:
            kw["stream_synthesis"] = True
        else:
            kw["fast"] = True
        m = estimate_method(self.method, self.model, wl, layout=self.layout, gpu=self.gpu,
                            alloc_conf=self.alloc_conf, torch_version=self.torch_version, **kw)
        w = m.worst
        # Fast mode traces the whole model where it cannot be shortened: its figures are then the full trace's.
        extrapolated = any(n.startswith("fast:") for n in m.notes) or self.method.startswith("pp")
        return MaxPoint(value=value, device_total_bytes=w.device_total_bytes,
                        peak_allocated_bytes=w.peak_allocated_bytes, peak_reserved_bytes=w.peak_reserved_bytes,
                        fits=all(r.fits for r in m.ranks), exact=exact or not extrapolated, rank=w.rank)

    @property
    def has_fast_mode(self) -> bool:
        """Whether a cheaper, inexact estimate exists to bracket the answer (a method's fast mode)."""
        return self.lengths is None and self.method != "single"


class _Search:
    """The search over multiples ``k`` of ``multiple_of``, ``1 <= k <= top``, with every point kept."""

    def __init__(self, probe: Callable[[int, bool], MaxPoint], *, multiple_of: int, top: int, limit_bytes: int):
        self.probe, self.step, self.top, self.limit = probe, multiple_of, top, limit_bytes
        self.points: dict[tuple[int, bool], MaxPoint] = {}

    def at(self, k: int, exact: bool) -> MaxPoint:
        key = (k, exact)
        fast = self.points.get((k, False))
        if exact and key not in self.points and fast is not None and fast.exact:
            self.points[key] = fast  # the fast estimate was the full trace's (a model too short to shorten)
        if key not in self.points:
            self.points[key] = self.probe(k * self.step, exact)
        return self.points[key]

    def bracket(self, exact: bool, first: int, hints: Sequence[int] = ()) -> tuple[int, int | None]:
        """(the largest fitting k found, 0 if none; the smallest failing k, or None when ``top`` fits),
        estimating ``first`` and then ``hints`` before any predicted k."""
        lo, hi = 0, None
        sides: list[bool] = []
        queue = [min(max(first, 1), self.top), *hints]
        while (lo < self.top) if hi is None else (hi - lo > 1):
            while queue and not (lo < queue[0] <= self.top and (hi is None or queue[0] < hi)):
                queue.pop(0)
            k = queue.pop(0) if queue else self._next(exact, lo, hi, sides)
            fits = self.at(k, exact).fits
            lo, hi = (k, hi) if fits else (lo, k)
            sides.append(fits)
        return lo, hi

    def _next(self, exact: bool, lo: int, hi: int | None, sides: list[bool]) -> int:
        """The next k to estimate: predicted where the need meets the limit, kept inside the bracket."""
        if lo == 0:
            return 1
        f_lo = self.at(lo, exact).device_total_bytes
        if hi is None:  # a line through the two largest fitting points, or doubling
            below = [k for (k, e), p in self.points.items() if e == exact and p.fits and k < lo]
            slope = (f_lo - self.at(max(below), exact).device_total_bytes) / (lo - max(below)) if below else 0
            guess = lo + int((self.limit - f_lo) / slope) if slope > 0 else 2 * lo
            return min(max(guess, lo + 1), self.top)
        if len(sides) >= 3 and sides[-1] == sides[-2] == sides[-3]:
            return (lo + hi) // 2  # the prediction keeps landing on one side: halve the bracket
        others = [k for (k, e) in self.points if e == exact and k not in (lo, hi)]
        near = min(others, key=lambda k: min(abs(k - lo), abs(k - hi)), default=None)
        xs = [lo, hi] + ([near] if near is not None else [])
        guess = _crossing([(k, self.at(k, exact).device_total_bytes) for k in xs], self.limit, lo, hi)
        if guess is None:
            return (lo + hi) // 2
        return min(max(int(guess), lo + 1), hi - 1)


def _crossing(points: list[tuple[int, int]], limit: int, lo: int, hi: int) -> float | None:
    """Where the need through ``points`` (a parabola through three, a line through two) meets ``limit``
    between ``lo`` and ``hi``; None where it does not. The need is affine in the batch and, with eager
    attention, quadratic in the length: three points give either exactly."""
    (x0, y0), (x1, y1) = points[:2]
    a = 0.0
    if len(points) == 3:
        x2, y2 = points[2]
        # The second divided difference: the parabola's leading coefficient (0 for a line).
        a = ((y2 - y0) / (x2 - x0) - (y1 - y0) / (x1 - x0)) / (x2 - x1)
    b = (y1 - y0) / (x1 - x0) - a * (x0 + x1)
    c = y0 - a * x0 * x0 - b * x0 - limit
    if abs(a) < 1e-12:
        return -c / b if b > 0 else None
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + sign * disc ** 0.5) / (2 * a) for sign in (1, -1)]
    inside = [x for x in roots if lo <= x <= hi]
    return min(inside) if inside else None


def _resolve(model: Any, workload: Any, kwargs: dict[str, Any], *, gpu: Any, gpu_memory: int | str | None,
             headroom: float | int | str, method: str, layout: Any, options: dict[str, Any] | None, lengths: Any,
             steps: int | None, alloc_conf: Any, torch_version: str | None) -> tuple[_Job, int, int]:
    """(the job, the GPU's capacity, the headroom in bytes)."""
    from llmem_plugin.estimate import _resolve_gpu, _workload_from

    wl = _workload_from(workload, kwargs)
    g = _resolve_gpu(gpu, gpu_memory)
    room = headroom_bytes(headroom, g.capacity_bytes)
    limited = dataclasses.replace(g, memory_bytes=g.capacity_bytes - room, driver_memory_bytes=None)
    if method != "single" and lengths is not None:
        raise ConfigError(f"variable lengths (--seq-lens) are replayed on one GPU, not with --method {method}. "
                          "HINT: drop --method, or give a fixed --seq-len (the longest)")
    if layout is None:
        from llmem_plugin.methods import Layout

        layout = Layout(num_gpus=1)
    if method == "single" and (layout.num_gpus != 1 or options):
        raise ConfigError(f"method 'single' is one GPU, but the layout has {layout.num_gpus} GPU(s)"
                          + (f" and options {sorted(options)}" if options else "")
                          + ". HINT: name the distributed method (method='ddp', 'fsdp', ...), or drop them")
    job = _Job(model=model, workload=wl, gpu=limited, method=method, layout=layout, options=dict(options or {}),
               lengths=lengths, steps=steps, alloc_conf=alloc_conf, torch_version=torch_version)
    return job, g.capacity_bytes, room


def _largest(job: _Job, what: str, *, capacity: int, room: int, multiple_of: int, limit: int,
             capped_by: str) -> MaxResult:
    """The search itself, for :func:`max_batch_size` and :func:`max_seq_len`."""
    t0 = time.perf_counter()
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ConfigError(f"multiple_of must be a positive integer, got {multiple_of!r}. HINT: pass --multiple-of 8")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < multiple_of:
        raise ConfigError(f"the search's limit {limit!r} is below the first value searched ({multiple_of}). "
                          f"HINT: pass a --limit of at least {multiple_of}")
    field, flag = _WHAT[what]
    search = _Search(lambda v, exact: job.at(what, v, exact=exact), multiple_of=multiple_of,
                     top=limit // multiple_of, limit_bytes=job.gpu.capacity_bytes)
    first = getattr(job.workload, field) // multiple_of
    if job.has_fast_mode:  # bracket with the fast mode, then settle both sides with the full trace's figures
        lo_fast, hi_fast = search.bracket(False, first)
        lo, hi = search.bracket(True, max(lo_fast, 1), [lo_fast + 1] if hi_fast is not None else [])
    else:
        lo, hi = search.bracket(True, first)
    if lo == 0:
        result = _result(job, what, search, 0, 1, capacity=capacity, room=room, capped_by=None, t0=t0)
        need = search.at(1, True).device_total_bytes
        raise WontFitError(f"even {flag} {multiple_of} does not fit: it needs {need / 2**30:.2f} GiB per GPU, "
                           f"{job.gpu.capacity_bytes / 2**30:.2f} GiB allowed ({job.gpu.name} less "
                           f"{room / 2**30:.2f} GiB headroom). HINT: `llmem plan` searches methods, checkpointing "
                           "and offload for a fit; or lower --headroom", report=result)
    return _result(job, what, search, lo, hi, capacity=capacity, room=room,
                   capped_by=capped_by if hi is None else None, t0=t0)


def _result(job: _Job, what: str, search: _Search, lo: int, hi: int | None, *, capacity: int, room: int,
            capped_by: str | None, t0: float) -> MaxResult:
    other = job.workload.seq_len if what == "batch_size" else job.workload.micro_batch_size
    points = sorted({id(p): p for p in search.points.values()}.values(), key=lambda p: (p.value, p.exact))
    return MaxResult(what=what, value=lo * search.step, next_value=None if hi is None else hi * search.step,
                     capped_by=capped_by, gpu=job.gpu.name, capacity_bytes=capacity, headroom_bytes=room,
                     limit_bytes=capacity - room, method=job.method, num_gpus=job.layout.num_gpus, fixed=other,
                     multiple_of=search.step, points=tuple(points), seconds=time.perf_counter() - t0)


def max_batch_size(model: Any, workload: Any = None, *, gpu: Any = None, gpu_memory: int | str | None = None,
                   headroom: float | int | str = DEFAULT_HEADROOM, method: str = "single", layout: Any = None,
                   options: dict[str, Any] | None = None, lengths: Any = None, steps: int | None = None,
                   multiple_of: int = 1, limit: int | None = None, alloc_conf: Any = None,
                   torch_version: str | None = None, **workload_fields: Any) -> MaxResult:
    """The largest micro-batch per GPU whose step fits the GPU less ``headroom``.

    Args:
        model, workload, gpu, gpu_memory, alloc_conf, torch_version, workload_fields: As
            :func:`llmem_plugin.estimate` takes them; the workload's
            ``micro_batch_size`` is what is searched, from its value.
        headroom: What to keep free: a fraction of the GPU's memory (a float),
            or a size (``"2GiB"``, or bytes as an int).
        method: A distributed method (:func:`llmem_plugin.methods.method_names`);
            its worst rank must fit. ``single``: one GPU.
        layout: The method's :class:`~llmem_plugin.methods.Layout` (default: one GPU).
        options: The method's options, as :func:`~llmem_plugin.methods.estimate_method` takes them.
        lengths: Sample lengths (``--seq-lens``): the worst step of a run of
            variable-length batches must fit (one GPU only).
        steps: With ``lengths``: optimizer steps replayed (default: until steady).
        multiple_of: Search only multiples of this.
        limit: The largest value searched (None: :data:`DEFAULT_BATCH_LIMIT`).

    Returns:
        The :class:`MaxResult`: the answer, the next value up (which does not
        fit) and every point estimated.

    Raises:
        WontFitError: Even ``multiple_of`` does not fit (``report`` carries the result).
        ConfigError, UnsupportedError, TraceError: As ``estimate`` raises them; a bad headroom.
    """
    job, capacity, room = _resolve(model, workload, workload_fields, gpu=gpu, gpu_memory=gpu_memory,
                                   headroom=headroom, method=method,
                                   layout=layout, options=options, lengths=lengths, steps=steps,
                                   alloc_conf=alloc_conf, torch_version=torch_version)
    limit = DEFAULT_BATCH_LIMIT if limit is None else limit
    return _largest(job, "batch_size", capacity=capacity, room=room, multiple_of=multiple_of, limit=limit,
                    capped_by=f"the search's limit of {limit}")


def max_seq_len(model: Any, workload: Any = None, *, gpu: Any = None, gpu_memory: int | str | None = None,
                headroom: float | int | str = DEFAULT_HEADROOM, method: str = "single", layout: Any = None,
                options: dict[str, Any] | None = None, lengths: Any = None, steps: int | None = None,
                multiple_of: int = 1, limit: int | None = None, alloc_conf: Any = None,
                torch_version: str | None = None, **workload_fields: Any) -> MaxResult:
    """The longest sequence (``seq_len``; with ``lengths``, the truncation length) whose step fits.

    Arguments as :func:`max_batch_size`, except ``limit``: None searches up to
    the model's context length (its ``max_position_embeddings``, or the rows
    of a learned position table), which ``capped_by`` then names.

    Raises:
        WontFitError: Even ``multiple_of`` tokens do not fit.
        ConfigError, UnsupportedError, TraceError: As ``estimate`` raises them.
    """
    job, capacity, room = _resolve(model, workload, workload_fields, gpu=gpu, gpu_memory=gpu_memory,
                                   headroom=headroom, method=method,
                                   layout=layout, options=options, lengths=lengths, steps=steps,
                                   alloc_conf=alloc_conf, torch_version=torch_version)
    capped_by = f"the search's limit of {limit}"
    if limit is None:
        limit, capped_by = context_length(model, job.workload)
    return _largest(job, "seq_len", capacity=capacity, room=room, multiple_of=multiple_of, limit=limit,
                    capped_by=capped_by)


def max_batch_table(model: Any, workload: Any = None, *, seq_lens: Sequence[int], **kwargs: Any) -> list[MaxResult]:
    """:func:`max_batch_size` at each of ``seq_lens``; a length where even one row does not fit gives a result
    with ``value`` 0 and its one point.

    Raises:
        ConfigError: An empty ``seq_lens``; as :func:`max_batch_size`.
    """
    from llmem_plugin.estimate import _workload_from

    if not seq_lens:
        raise ConfigError("seq_lens is empty. HINT: pass the lengths to tabulate, e.g. --at-lens 1024,2048,4096")
    base = _workload_from(workload, {k: v for k, v in kwargs.items() if k not in _SEARCH_ARGS})
    search = {k: v for k, v in kwargs.items() if k in _SEARCH_ARGS}
    out = []
    for n in seq_lens:
        try:
            out.append(max_batch_size(model, dataclasses.replace(base, seq_len=n), **search))
        except WontFitError as e:
            out.append(e.report)
    return out


_SEARCH_ARGS = ("gpu", "gpu_memory", "headroom", "method", "layout", "options", "lengths", "steps", "multiple_of", "limit",
                "alloc_conf", "torch_version")


def context_length(model: Any, workload: Any) -> tuple[int, str]:
    """(the longest sequence the model takes, what says so): a learned position table's rows, else the
    config's ``max_position_embeddings`` (or ``n_positions``), else :data:`DEFAULT_SEQ_LIMIT`."""
    from llmem_plugin.models import modelbuild
    from llmem_plugin.models.config import is_litgpt_source, resolve_config

    if is_litgpt_source(model):  # litgpt's GPT refuses a sequence past its block size (llmem_plugin.models.litgpt)
        n = int(modelbuild.build_model(model, dataclasses.replace(workload, seq_len=1)).config.block_size)
        return n, f"the model's block size ({n}); litgpt refuses longer sequences"
    try:
        config = resolve_config(model)
    except ConfigError:
        raise
    except Exception:  # a module: read it below
        config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    table = modelbuild.position_limit(modelbuild.build_model(model, dataclasses.replace(workload, seq_len=1))) \
        if _learns_positions(config) else None
    if table is not None:
        return table, f"the model's learned position table ({table} positions)"
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "block_size"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 0:
            return n, f"the model's context length ({name}={n}); pass --limit to search further"
    return DEFAULT_SEQ_LIMIT, f"the search's limit of {DEFAULT_SEQ_LIMIT}"


def _learns_positions(config: Any) -> bool:
    """Whether the model may hold a learned absolute position table (no rotary or ALiBi positions)."""
    if config is None:
        return True
    kind = getattr(config, "position_embedding_type", "absolute")
    rotary = getattr(config, "rope_theta", None) is not None or getattr(config, "rope_scaling", None) is not None \
        or getattr(config, "rope_parameters", None) is not None
    return kind == "absolute" and not rotary and not getattr(config, "alibi", False)
