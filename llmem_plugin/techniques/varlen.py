"""Variable-length batches: many steps of different shapes through the allocator.

With dynamic padding every micro-batch is padded to its own longest sample, so
each step has a different shape, and over hundreds of steps the caching
allocator fragments more than a replay of one fixed-shape step shows. This
module replays a realistic run:

1. **Lengths.** A sample-length distribution (:func:`parse_lengths`): lengths
   read from a file, a histogram, ``min:max`` (uniform) or ``min:max:mean``
   (the maximum-entropy distribution on ``[min, max]`` with that mean, a
   truncated exponential). Each micro-batch draws ``micro_batch_size``
   samples (a seeded random sampler) and is padded to the longest, capped at
   the workload's ``seq_len`` (truncation).
2. **Derivation, not one trace per step.** The step is traced at three
   lengths on a :data:`GRID`-token grid and once off the grid. Every trace
   must have the same event stream structure (the same allocations and frees
   in the same order); each event's size is then a quadratic in the length,
   fitted exactly through the three grid traces. An event the off-grid trace
   confirms is exact at every length; one whose size is padded inside a
   kernel (attention kernels round the length up to 32 or 128) takes the
   quadratic at the length rounded up to the grid, which is never below its
   true size (checked at the off-grid length). Anything else is refused.
3. **Replay.** The derived streams of N steps run through one simulated
   allocator (its cache carried from step to step), capped at the GPU's
   memory as a real run is. N defaults to the number of steps after which
   reserved memory stops growing (checked over a window of steps).

Sources: transformers' ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq``
pad each batch to its longest sample (``padding=True``, "longest"), and the
HF Trainer's default train sampler is a ``RandomSampler``.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
import itertools
import json
import math
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from llmem_plugin.errors import ConfigError, UnsupportedError

__all__ = ["GRID", "Lengths", "VarLenEstimate", "estimate_variable_length", "parse_lengths", "step_lengths"]

# Lengths traced lie on this grid: the largest length padding of the attention
# kernels emulated (flash's softmax_d and dq_accum round s_q up to 128,
# mem-efficient's logsumexp to 32: llmem_plugin/trace/emulation/sdpa.py).
GRID = 128
_FINE = 32  # the grid below 128 tokens: mem-efficient attention pads to 32
_MAX_LENGTH_VALUES = 10_000_000
# The replay's stopping rule counts micro-batches, the shapes the allocator sees (with gradient
# accumulation an optimizer step holds many): at least this many replayed when N is not given,
DEFAULT_STEPS_MIN = 200
STEADY_WINDOW = 100  # and reserved unchanged over the last this many: the steady state
MAX_STEPS = 5000


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A distribution of sample lengths (tokens).

    Attributes:
        values: Distinct lengths, ascending.
        weights: Their relative frequencies.
        source: How it was given, for the report.
    """

    values: tuple[int, ...]
    weights: tuple[float, ...]
    source: str

    @property
    def mean(self) -> float:
        total = sum(self.weights)
        return sum(v * w for v, w in zip(self.values, self.weights)) / total

    def draw(self, rng: random.Random, n: int) -> list[int]:
        cum = self.__dict__.get("_cum")
        if cum is None:
            cum = list(itertools.accumulate(self.weights))
            object.__setattr__(self, "_cum", cum)
        return rng.choices(self.values, cum_weights=cum, k=n)


def _bad(spec: str, why: str) -> ConfigError:
    return ConfigError(f"sequence lengths {spec!r}: {why}. HINT: pass --seq-lens FILE (one length per line, a "
                       "JSON list, or JSONL rows with 'length' or 'input_ids'), MIN:MAX, MIN:MAX:MEAN, or a "
                       "histogram LEN:COUNT,LEN:COUNT")


def _positive(spec: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(spec, f"{text!r} is not an integer") from None
    if value <= 0:
        raise _bad(spec, f"length {value} is not positive")
    return value


def _from_counts(counts: dict[int, float], source: str, spec: str) -> Lengths:
    counts = {k: v for k, v in counts.items() if v > 0}
    if not counts:
        raise _bad(spec, "no lengths")
    values = tuple(sorted(counts))
    return Lengths(values, tuple(float(counts[v]) for v in values), source)


def _max_entropy(lo: int, hi: int, mean: float, spec: str) -> Lengths:
    """p(x) proportional to exp(t x) on the integers lo..hi, t solved so the mean matches."""
    if not lo < mean < hi:
        raise _bad(spec, f"the mean {mean:g} must lie strictly between MIN {lo} and MAX {hi}")
    xs = range(lo, hi + 1)
    span = hi - lo

    def weights(t: float) -> list[float]:
        return [math.exp(t * (x - lo) / span) for x in xs] if span else [1.0]

    def mean_of(t: float) -> float:
        w = weights(t)
        return sum(x * wi for x, wi in zip(xs, w)) / sum(w)

    a, b = -700.0, 700.0  # t * (x - lo) / span stays within exp's range
    for _ in range(200):
        mid = (a + b) / 2
        if mean_of(mid) < mean:
            a = mid
        else:
            b = mid
    w = weights((a + b) / 2)
    return Lengths(tuple(xs), tuple(w), f"max-entropy on {lo}..{hi} with mean {mean:g}")


def _read_file(path: Path, spec: str) -> Lengths:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(spec, f"cannot read the file ({e.__class__.__name__})") from None
    counts: dict[int, float] = {}

    def add(value: Any, where: str) -> None:
        if isinstance(value, dict):
            if "length" in value:
                value = value["length"]
            elif "input_ids" in value and isinstance(value["input_ids"], list):
                value = len(value["input_ids"])
            else:
                raise _bad(spec, f"{where}: a row needs 'length' or 'input_ids'")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _bad(spec, f"{where}: {value!r} is not a positive integer length")
        counts[value] = counts.get(value, 0) + 1

    stripped = text.strip()
    if path.suffix == ".json" or stripped.startswith(("[", "{")) and path.suffix != ".jsonl":
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise _bad(spec, f"not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):  # {"length": count}
            for k, v in data.items():
                length = _positive(spec, k)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise _bad(spec, f"count {v!r} of length {k} is not a number >= 0")
                counts[length] = counts.get(length, 0) + v
        elif isinstance(data, list):
            for i, v in enumerate(data):
                add(v, f"item {i}")
        else:
            raise _bad(spec, "the JSON is neither a list of lengths nor a {length: count} object")
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    add(json.loads(line), f"line {n}")
                except json.JSONDecodeError:
                    raise _bad(spec, f"line {n} is not valid JSON") from None
            else:
                add(_positive(spec, line), f"line {n}")
            if len(counts) > _MAX_LENGTH_VALUES:
                raise _bad(spec, "too many distinct lengths")
    return _from_counts(counts, f"{sum(counts.values()):g} samples from {path.name}", spec)


def parse_lengths(spec: str | Lengths) -> Lengths:
    """A length distribution from its command-line spelling (see the module doc).

    Raises:
        ConfigError: An unreadable file, a bad number, or an empty distribution.
    """
    if isinstance(spec, Lengths):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "empty")
    spec = spec.strip()
    path = Path(spec)
    if path.suffix in (".txt", ".json", ".jsonl", ".csv") or path.exists():
        if not path.is_file():
            raise _bad(spec, "no such file")
        return _read_file(path, spec)
    if "," in spec:  # a histogram (a single bin: "LEN:COUNT,")
        counts: dict[int, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if ":" not in part:
                raise _bad(spec, f"histogram bin {part!r} is not LEN:COUNT")
            length, _, count = part.partition(":")
            try:
                c = float(count)
            except ValueError:
                raise _bad(spec, f"count {count!r} is not a number") from None
            if c < 0:
                raise _bad(spec, f"count {count} is negative")
            counts[_positive(spec, length)] = counts.get(_positive(spec, length), 0) + c
        return _from_counts(counts, f"histogram {spec}", spec)
    parts = spec.split(":")
    if len(parts) == 2:
        lo, hi = (_positive(spec, p) for p in parts)
        if lo > hi:
            raise _bad(spec, f"MIN {lo} exceeds MAX {hi}")
        return Lengths(tuple(range(lo, hi + 1)), (1.0,) * (hi - lo + 1), f"uniform on {lo}..{hi}")
    if len(parts) == 3:
        lo, hi = _positive(spec, parts[0]), _positive(spec, parts[1])
        try:
            mean = float(parts[2])
        except ValueError:
            raise _bad(spec, f"MEAN {parts[2]!r} is not a number") from None
        return _max_entropy(lo, hi, mean, spec)
    raise _bad(spec, "not a file, MIN:MAX, MIN:MAX:MEAN or a LEN:COUNT histogram")


def step_lengths(lengths: Lengths, *, micro_batch_size: int, grad_accum_steps: int, max_len: int, steps: int,
                 seed: int = 0) -> list[list[int]]:
    """Padded length of every micro-batch of ``steps`` optimizer steps.

    Each micro-batch draws ``micro_batch_size`` samples and is padded to the
    longest, truncated at ``max_len``.
    """
    rng = random.Random(seed)
    return [[min(max(lengths.draw(rng, micro_batch_size)), max_len) for _ in range(grad_accum_steps)]
            for _ in range(steps)]


# ----------------------------------------------------------------------------- derivation


@dataclasses.dataclass(frozen=True)
class _Traced:
    events: list[tuple[int, int, int]]  # allocator events (workspaces included)
    labels: list[str]
    bounds: tuple[int, ...]  # segment starts: per iteration, each traced micro-step, then the optimizer

    @property
    def signature(self) -> tuple:
        return (self.bounds, tuple((e[0], e[1]) for e in self.events))


def _round_up(s: int, unit: int) -> int:
    return -(-s // unit) * unit


def _fit(points: list[tuple[int, int]]) -> tuple[Fraction, Fraction, Fraction]:
    """Exact a + b s + c s^2 through three (s, size) points (Lagrange)."""
    (x0, y0), (x1, y1), (x2, y2) = points
    c0 = Fraction(y0, (x0 - x1) * (x0 - x2))
    c1 = Fraction(y1, (x1 - x0) * (x1 - x2))
    c2 = Fraction(y2, (x2 - x0) * (x2 - x1))
    a = c0 * x1 * x2 + c1 * x0 * x2 + c2 * x0 * x1
    b = -(c0 * (x1 + x2) + c1 * (x0 + x2) + c2 * (x0 + x1))
    c = c0 + c1 + c2
    return a, b, c


def _at(coef: tuple[Fraction, Fraction, Fraction], s: int) -> int:
    """The fitted size at ``s``, rounded as the trace records sizes (the allocator's 512-byte blocks)."""
    from llmem_plugin.trace.tracker import round_allocation

    a, b, c = coef
    return round_allocation(max(math.ceil(a + b * s + c * s * s), 0))


def _roles(bounds: tuple[int, ...], n: int) -> list[tuple[int, int, str]]:
    """(start, end, role) of each segment: setup, then per iteration its micro-steps and optimizer."""
    micro = (len(bounds) - 2) // 2
    names = ["setup"] + [f"{it}:{m}" for it in (1, 2) for m in [*(f"m{k}" for k in range(micro)), "opt"]]
    edges = [0, *bounds, n]
    return [(edges[i], edges[i + 1], names[i]) for i in range(len(names))]


@dataclasses.dataclass
class Derivation:
    """Each event's size as a function of the sequence length, for one event structure.

    Attributes:
        lengths: The lengths traced for it: three grid lengths and an
            off-grid check, or one length traced exactly.
        exact: Per event, True when the quadratic is exact at every length,
            False when it is evaluated at the length rounded up to ``unit``.
        unit: The grid step of the lengths fitted (128, or 32 below 128 tokens).
        steps: Below 128 tokens, each 32-token grid length's traced sizes:
            there an event the quadratic does not give exactly takes its
            size at the grid length at or above (see :func:`derive_fine`).
        escapes: Allocations that outlive their segment (gradients made in a
            micro-step and freed by the optimizer, optimizer states), as
            (segment role, ordinal): what a later segment's free refers to,
            the same in every structure of the step.
    """

    lengths: tuple[int, ...]
    signs: list[int]
    keys: list[int]
    bounds: tuple[int, ...]
    coefs: list[tuple[Fraction, Fraction, Fraction]]
    exact: list[bool]
    unit: int = GRID
    escapes: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)
    steps: dict[int, list[int]] | None = None

    def __post_init__(self) -> None:
        frees_at = {}
        for i, (sign, key) in enumerate(zip(self.signs, self.keys)):
            if sign < 0:
                frees_at[key] = i
        for lo, hi, role in _roles(self.bounds, len(self.signs)):
            n = 0
            for i in range(lo, hi):
                if self.signs[i] > 0 and frees_at.get(self.keys[i], len(self.signs)) >= hi:
                    self.escapes[self.keys[i]] = (role, n)
                    n += 1

    def sizes(self, s: int) -> list[int]:
        up = _round_up(s, self.unit)
        if self.steps is not None:
            row = self.steps[up]
            return [_at(c, s) if e else row[i] for i, (c, e) in enumerate(zip(self.coefs, self.exact))]
        return [_at(c, s if e else up) for c, e in zip(self.coefs, self.exact)]

    @property
    def num_padded(self) -> int:
        return self.exact.count(False)

    @classmethod
    def traced(cls, s: int, t: _Traced) -> Derivation:
        """Sizes of the one length traced."""
        return cls((s,), [e[0] for e in t.events], [e[1] for e in t.events], t.bounds,
                   [(Fraction(e[2]), Fraction(0), Fraction(0)) for e in t.events], [True] * len(t.events))


def _alike(traced: dict[int, _Traced], base: int, others: tuple[int, ...]) -> _Traced:
    """The trace at ``base``, once every trace at ``others`` has its event structure.

    Raises:
        UnsupportedError: One does not (a kernel choice that depends on the length's alignment).
    """
    for s in others:
        if traced[s].signature != traced[base].signature:
            raise UnsupportedError(
                f"the step's allocations at {s} tokens differ in structure from those at {base} tokens, which "
                "the derivation found alike (a kernel choice that depends on the length's alignment). HINT: "
                "estimate the longest length with --seq-len alone")
    return traced[base]


def derive(traced: dict[int, _Traced], grid: tuple[int, int, int], check: int) -> Derivation:
    """Fit every event's size through the grid traces and classify it with the check trace.

    Raises:
        UnsupportedError: The traces' structures differ, or an event's size
            is neither a quadratic nor bounded by the grid round-up.
    """
    first = _alike(traced, grid[0], (*grid[1:], check))
    coefs, exact = [], []
    for i in range(len(first.events)):
        coef = _fit([(s, traced[s].events[i][2]) for s in grid])
        actual = traced[check].events[i][2]
        if _at(coef, check) == actual:
            exact.append(True)
        elif _at(coef, _round_up(check, GRID)) >= actual:
            exact.append(False)
        else:
            raise UnsupportedError(
                f"allocation event {i} of the step grows with the length in a way the derivation does not "
                f"bound ({actual} bytes at {check} tokens). HINT: estimate the longest length with --seq-len alone")
        coefs.append(coef)
    return Derivation((*grid, check), [e[0] for e in first.events], [e[1] for e in first.events], first.bounds,
                      coefs, exact)


def derive_fine(traced: dict[int, _Traced], pts: list[int], checks: tuple[int, ...]) -> Derivation:
    """Below 128 tokens: sizes from the 32-token grid traces ``pts`` themselves.

    The trace records sizes in the allocator's 512-byte blocks, and on a
    32-token grid a small tensor's rounded size (4 bytes a token, say) is a
    step function no quadratic through three grid lengths gives. An event is
    exact when the quadratic reproduces every grid length and every off-grid
    check; any other takes its traced size at the grid length at or above,
    which each check confirms is never below the true size.

    Raises:
        UnsupportedError: The traces' structures differ, or a check finds an
            event larger than at the grid length above it.
    """
    first = _alike(traced, pts[0], (*pts[1:], *checks))
    g = (pts[0], pts[len(pts) // 2], pts[-1])
    steps = {s: [e[2] for e in traced[s].events] for s in pts}
    coefs, exact = [], []
    for i in range(len(first.events)):
        coef = _fit([(s, traced[s].events[i][2]) for s in g])
        exact.append(all(_at(coef, s) == traced[s].events[i][2] for s in (*pts, *checks)))
        for c in checks:
            if not exact[-1] and steps[_round_up(c, _FINE)][i] < traced[c].events[i][2]:
                raise UnsupportedError(
                    f"allocation event {i} of the step is larger at {c} tokens than at the grid length above "
                    "(a size that shrinks as the length grows). HINT: estimate the longest length with --seq-len "
                    "alone")
        coefs.append(coef)
    return Derivation((*pts, *checks), [e[0] for e in first.events], [e[1] for e in first.events], first.bounds,
                      coefs, exact, unit=_FINE, steps=steps)


_MAX_EXACT_TRACES = 48  # lengths traced one by one in regimes too short for a fit


@dataclasses.dataclass
class Piecewise:
    """Derivations over the length range: one per event structure (regime).

    Attributes:
        regimes: (first length, last length, derivation), ascending; a
            regime too short for a fit holds one traced length.
        traces: Lengths traced in all.
    """

    regimes: list[tuple[int, int, Derivation]]
    traces: int

    def at(self, s: int) -> Derivation:
        for lo, hi, der in self.regimes:
            if lo <= s <= hi:
                return der
        raise AssertionError(f"length {s} outside the derived range")  # every needed length is covered

    @property
    def switches(self) -> list[int]:
        """Lengths at which the event structure changes."""
        out = []
        for (_, _, a), (lo, _, b) in zip(self.regimes, self.regimes[1:]):
            if a.bounds != b.bounds or a.signs != b.signs or a.keys != b.keys:
                out.append(lo)
        return out


def piecewise(needed: list[int], trace_at) -> Piecewise:
    """Derivations covering every length in ``needed``.

    Grid lengths are traced as needed: where two grid lengths' event
    structures differ, the range is bisected down to adjacent grid lengths
    and then to the exact switch length (each regime is taken as contiguous;
    a run of equal structures is confirmed at its ends and middle).

    Raises:
        UnsupportedError: A length whose structure matches neither side of a
            switch, a short regime needing too many exact traces, or a
            derivation that fails (:func:`derive`).
    """
    traces = _Traces(trace_at)
    low, high = min(needed), max(needed)
    grid = _grid(low, high)
    runs = _runs(grid, traces.sig)
    firsts = _switch_lengths(grid, runs, traces.sig)
    regimes = _Regimes(needed, traces)
    if low < grid[0]:  # below the finest grid: each length as traced
        regimes.exact(low, grid[0] - 1)
    for k, (a, b) in enumerate(runs):
        last = firsts[k + 1] - 1 if k + 1 < len(runs) else high
        regimes.run(firsts[k], last, grid[a: b + 1], first_run=k == 0, last_run=k == len(runs) - 1)
    return Piecewise(regimes.regimes, len(traces.cache))


# The steps of piecewise(), in its order: the grid lengths, the runs of grid
# lengths with one event structure, the exact length where each run starts, and
# each run's derivation (a fit, the 32-token grid's table, or lengths traced one by one).


class _Traces:
    """The traces by length, each traced once (``trace_at``), and their event structures."""

    def __init__(self, trace_at) -> None:
        self.trace_at = trace_at
        self.cache: dict[int, _Traced] = {}

    def __call__(self, s: int) -> _Traced:
        if s not in self.cache:
            self.cache[s] = self.trace_at(s)
        return self.cache[s]

    def sig(self, s: int) -> tuple:
        return self(s).signature


def _grid(low: int, high: int) -> list[int]:
    """The grid lengths over ``low..high``: 128-token steps, and 32-token steps
    below 128 (mem-efficient attention's padding unit) where needed; at least three."""
    grid = [x for x in range(max(_FINE, low // _FINE * _FINE), GRID, _FINE)]
    grid += list(range(GRID, max(-(-high // GRID) * GRID, GRID) + 1, GRID))
    while len(grid) < 3:
        grid.append(grid[-1] + GRID)
    return grid


def _runs(grid: list[int], sig) -> list[tuple[int, int]]:
    """The runs of ``grid`` indices (first, last) whose lengths share an event
    structure (``sig``), found by bisecting wherever a range's ends and middle differ."""
    cuts: list[int] = []  # grid indices i with sig(grid[i]) != sig(grid[i + 1])

    def split(i: int, j: int) -> None:
        if j - i <= 1:
            if sig(grid[i]) != sig(grid[j]):
                cuts.append(i)
            return
        m = (i + j) // 2
        if sig(grid[i]) == sig(grid[j]) == sig(grid[m]):
            return
        split(i, m)
        split(m, j)

    split(0, len(grid) - 1)
    runs, start = [], 0
    for c in sorted(cuts):
        runs.append((start, c))
        start = c + 1
    runs.append((start, len(grid) - 1))
    return runs


def _switch_lengths(grid: list[int], runs: list[tuple[int, int]], sig) -> list[int]:
    """The first length of each run: the grid's first, then each exact switch
    length, the first with the next run's structure (bisected between adjacent grid lengths).

    Raises:
        UnsupportedError: A length between two runs whose structure matches neither.
    """
    firsts = [grid[0]]
    for (_, b), (c, _) in zip(runs, runs[1:]):
        left, right = grid[b], grid[c]  # adjacent grid lengths
        a, z = left, right  # sig(a) is the left run's, sig(z) the right's
        while z - a > 1:
            m = (a + z) // 2
            if sig(m) == sig(left):
                a = m
            elif sig(m) == sig(right):
                z = m
            else:
                raise UnsupportedError(f"the step's allocations at {m} tokens match neither {left} nor {right} "
                                       "tokens. HINT: estimate the longest length with --seq-len alone")
        firsts.append(z)
    return firsts


class _Regimes:
    """The regimes of :func:`piecewise`, derived run by run over the lengths ``needed``."""

    def __init__(self, needed: list[int], traces: _Traces) -> None:
        self.needed, self.t, self.sig = needed, traces, traces.sig
        self.regimes: list[tuple[int, int, Derivation]] = []

    def run(self, first: int, last: int, pts: list[int], *, first_run: bool, last_run: bool) -> None:
        """The run of grid lengths ``pts`` over ``first..last``; the first and last runs may continue past the range."""
        fine = [x for x in pts if x < GRID]
        if fine and len(fine) < len(pts) and first < GRID <= last:
            # One structure across 128 tokens: a size padded to 128 inside a kernel (flash attention's
            # softmax_lse) is constant below 128 and a step function above it, which no quadratic through
            # 32-token and 128-token grid lengths together bounds; fit each side on its own grid.
            self.table(first, GRID - 1, fine[0], first_run, True)  # the run goes on past 128: its grid lengths serve
            self.fit(GRID, last, [x for x in pts if x >= GRID], False, last_run)
        else:
            self.fit(first, last, list(pts), first_run, last_run)

    def wanted(self, first: int, last: int) -> int:
        return len({s for s in self.needed if first <= s <= last})

    def exact(self, first: int, last: int) -> None:
        """Each needed length in ``first..last`` as traced.

        Raises:
            UnsupportedError: More than :data:`_MAX_EXACT_TRACES` of them.
        """
        wanted = sorted({s for s in self.needed if first <= s <= last})
        if len(wanted) > _MAX_EXACT_TRACES:
            raise UnsupportedError(
                f"the step's allocations change structure at {first} and {last + 1} tokens, too close together for "
                f"a fit, and {len(wanted)} lengths fall between them. HINT: narrow the length range, or estimate the "
                "longest length with --seq-len alone")
        self.regimes.extend((s, s, Derivation.traced(s, self.t(s))) for s in wanted)

    def table(self, first: int, last: int, ref: int, at_low_end: bool, at_high_end: bool) -> None:
        """The regime of grid length ``ref`` over ``first..last`` from its 32-token grid traces
        (:func:`derive_fine`). Each length takes the grid length at or above it; where that has another
        structure (the regime ends off the grid) the lengths above the last grid length are traced one by
        one. A regime at either end of the range may continue past it: grid lengths there serve its table."""
        sig = self.sig
        start, top = _round_up(first, _FINE), last // _FINE * _FINE
        if at_high_end and top < last and sig(_round_up(last, _FINE)) == sig(ref):
            top = _round_up(last, _FINE)
        while at_high_end and top >= last and (top - start) // _FINE < 2 and sig(top + _FINE) == sig(ref):
            top += _FINE
        pts = list(range(start, top + 1, _FINE))
        while at_low_end and 0 < len(pts) < 3 and pts[0] - _FINE >= _FINE and sig(pts[0] - _FINE) == sig(ref):
            pts.insert(0, pts[0] - _FINE)
        if len(pts) < 3 or any(sig(x) != sig(ref) for x in pts):
            self.exact(first, last)
            return
        checks = (pts[0] + _FINE // 2 + 1, pts[-2] + _FINE // 2 + 3)
        try:
            der = derive_fine({s: self.t(s) for s in (*pts, *checks)}, pts, checks)
        except UnsupportedError:
            if self.wanted(first, last) > _MAX_EXACT_TRACES:
                raise
            self.exact(first, last)
            return
        self.regimes.append((first, min(top, last), der))
        if top < last:
            self.exact(top + 1, last)

    def fit(self, first: int, last: int, pts: list[int], at_low_end: bool, at_high_end: bool) -> None:
        """The regime over ``first..last`` fitted through its grid lengths ``pts`` (:func:`derive`)."""
        if pts[0] < GRID:  # below 128 tokens: the 32-token grid's own traces
            self.table(first, last, pts[0], at_low_end, at_high_end)
            return
        # A regime at the top of the range may continue past it: grid lengths there serve its fit.
        while len(pts) < 3 and at_high_end and self.sig(pts[-1] + GRID) == self.sig(pts[0]):
            pts.append(pts[-1] + GRID)
        if len(pts) < 3:  # too few 128-token grid lengths for a quadratic: the 32-token grid
            self.table(first, last, pts[0], False, at_high_end)
            return
        g = (pts[0], pts[len(pts) // 2], pts[-1])
        check = pts[0] + GRID // 2 + 1
        try:
            self.regimes.append((first, last, derive({s: self.t(s) for s in (*g, check)}, g, check)))
        except UnsupportedError:  # a size no quadratic bounds (a kernel's launch arithmetic)
            if self.wanted(first, last) > _MAX_EXACT_TRACES:
                raise
            self.exact(first, last)


# ----------------------------------------------------------------------------- tracing


def _boundaries(trace: Any, events: list[tuple[int, int, int]], micro_steps: int) -> tuple[int, ...]:
    """Segment starts in the allocator-event stream: each traced micro-step and each optimizer phase."""
    from llmem_plugin.estimate import trace_positions
    from llmem_plugin.trace.step import micro_mark
    from llmem_plugin.trace.tracker import Phase

    where = trace_positions(events)
    phases = [p for _, p, _ in trace.timeline]
    starts = []
    for it in range(2):
        for mb in range(micro_steps):
            pos = trace.marks.get(micro_mark(it, mb))
            if pos is None:
                raise UnsupportedError("the trace lacks its micro-step marks; variable-length replay needs them")
            starts.append(pos)
        opt = next((i for i in range(starts[-1], len(phases)) if phases[i] is Phase.OPTIMIZER), len(phases))
        starts.append(opt)
    return tuple(where[p] for p in starts)


def _trace_at(model: Any, wl: Any, s: int, *, fast: bool, ctx: dict) -> _Traced:
    from llmem_plugin.models import modelbuild

    est = importlib.import_module("llmem_plugin.estimate")  # the package's `estimate` is the function
    w = dataclasses.replace(wl, seq_len=s, grad_accum_steps=ctx["micro"])
    trace = None
    if fast:
        from llmem_plugin.trace.fast import extrapolated_trace
        from llmem_plugin.trace.fastsynth import SynthesisError, full_depth_trace

        def tr(m, w2, tag=False):
            return est._trace(m, w2, ctx["gpu"], tag_layers=tag)

        ext = extrapolated_trace(model, w, depth=ctx["depth"], trace=lambda m, w2: tr(m, w2, True), trace_full=tr)
        if ext.result is not None and ext.short is not None:
            try:
                trace = full_depth_trace(ext.short, ext.long, ext.plan, ext.result)
            except SynthesisError:
                trace = None
        elif ext.result is not None and ext.result.events:
            trace = ext.result
    if trace is None:
        trace = est._trace(modelbuild.build_model(model, w, device="meta"), w, ctx["gpu"])
    events, labels = est.allocator_events(trace, ctx["overheads"])
    return _Traced(events, labels, _boundaries(trace, events, ctx["micro"]))


# ----------------------------------------------------------------------------- replay


@dataclasses.dataclass(frozen=True)
class VarLenEstimate:
    """A run of steps with varying lengths, replayed through the allocator.

    Attributes:
        lengths: The sample-length distribution.
        steps: Optimizer steps replayed.
        warmup_steps: Steps until reserved memory stopped growing (the last
            step that grew it, plus one).
        step_lengths: Padded length of each micro-batch, per step.
        peak_allocated_bytes: Highest allocated over the run.
        peak_reserved_bytes: Highest reserved over the run.
        reserved_after_warmup_bytes: Reserved at the end of the warm-up.
        worst_step: The step (0-based) with the highest allocated.
        step_allocated_bytes: Peak allocated of each step.
        step_reserved_bytes: Reserved at the end of each step.
        fixed_allocated_bytes, fixed_reserved_bytes: A run whose every
            micro-batch has the longest length seen, for comparison.
        device_total_bytes: Peak reserved plus the device overheads outside
            the allocator.
        capacity_bytes: The GPU's memory.
        fits: Whether the run completes on the GPU.
        alloc_retries: Times the allocator freed its cache and retried.
        derivation: How sizes were derived: the regimes of event structure,
            the lengths traced for each, the switch lengths.
    """

    lengths: Lengths
    steps: int
    warmup_steps: int
    step_lengths: list[list[int]]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_after_warmup_bytes: int
    worst_step: int
    step_allocated_bytes: list[int]
    step_reserved_bytes: list[int]
    fixed_allocated_bytes: int
    fixed_reserved_bytes: int
    device_total_bytes: int
    capacity_bytes: int
    fits: bool
    alloc_retries: int
    derivation: Piecewise

    @property
    def longest(self) -> int:
        return max(s for step in self.step_lengths for s in step)

    def to_dict(self) -> dict:
        d = self.derivation
        return {
            "lengths": {"source": self.lengths.source, "mean": self.lengths.mean,
                        "min": self.lengths.values[0], "max": self.lengths.values[-1]},
            "steps": self.steps, "warmup_steps": self.warmup_steps, "worst_step": self.worst_step,
            "longest_micro_batch": self.longest,
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "reserved_after_warmup_bytes": self.reserved_after_warmup_bytes,
            "fixed_allocated_bytes": self.fixed_allocated_bytes, "fixed_reserved_bytes": self.fixed_reserved_bytes,
            "device_total_bytes": self.device_total_bytes, "capacity_bytes": self.capacity_bytes, "fits": self.fits,
            "alloc_retries": self.alloc_retries,
            "derivation": {"lengths_traced": d.traces, "switch_lengths": d.switches,
                           "regimes": [{"first": lo, "last": hi, "traced": list(der.lengths),
                                        "padded_events": der.num_padded} for lo, hi, der in d.regimes]},
            "step_lengths": self.step_lengths,
            "step_allocated_bytes": self.step_allocated_bytes, "step_reserved_bytes": self.step_reserved_bytes,
        }


class _Composer:
    """Builds the allocator events of a run step by step (see :func:`compose`)."""

    def __init__(self, model: Piecewise) -> None:
        self.model = model
        self.counter = itertools.count(10**12)
        self.sizes_of: dict[int, list[int]] = {}
        self.canon: dict[tuple[str, int], int] = {}  # escaping allocation -> its key in the run
        self.micro = (len(model.regimes[0][2].bounds) - 2) // 2

    def _emit(self, out: list[tuple[int, int, int]], s: int, role: str) -> None:
        der = self.model.at(s)
        if s not in self.sizes_of:
            self.sizes_of[s] = der.sizes(s)
        size = self.sizes_of[s]
        lo, hi = next((lo, hi) for lo, hi, r in _roles(der.bounds, len(der.signs)) if r == role)
        local: dict[int, int] = {}
        for i in range(lo, hi):
            sign, key = der.signs[i], der.keys[i]
            esc = der.escapes.get(key)
            if sign > 0:
                new = next(self.counter)
                if esc is not None:
                    self.canon[esc] = new
                else:
                    local[key] = new
                out.append((1, new, size[i]))
            else:
                target = self.canon.get(esc) if esc is not None else local.get(key)
                if target is not None:  # else a block the run never made (none in a checked model)
                    out.append((-1, target, 0))

    def setup(self, s: int) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        self._emit(out, s, "setup")
        return out

    def step(self, n: int, lengths: list[int]) -> list[tuple[int, int, int]]:
        """Step ``n`` (0-based): the trace's first iteration for step 0, its second after."""
        out: list[tuple[int, int, int]] = []
        it = 1 if n == 0 else 2
        for m, s in enumerate(lengths):
            self._emit(out, s, f"{it}:m{min(m, self.micro - 1)}")  # later micro-steps repeat the last traced
        self._emit(out, lengths[-1], f"{it}:opt")
        return out


def compose(model: Piecewise, plan: list[list[int]]) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The allocator events of a run whose steps have the micro-batch lengths ``plan``.

    Step 1 is the trace's first iteration (it creates the optimizer states),
    every later step its second; a micro-step beyond the traced ones repeats
    the last traced. Each micro-step takes the structure of its own length;
    allocations that outlive a segment are matched across structures by
    their (segment role, ordinal).
    """
    c = _Composer(model)
    events, labels = c.setup(plan[0][0]), []
    labels = ["setup"] * len(events)
    for n, step in enumerate(plan):
        ev = c.step(n, step)
        events += ev
        labels += [f"step {n}"] * len(ev)
    return events, labels


@dataclasses.dataclass
class _Run:
    step_allocated: list[int]
    step_reserved: list[int]
    peak_allocated: int
    peak_reserved: int
    retries: int
    oom: bool


def _simulate(model: Piecewise, plan: list[list[int]], config: Any, capacity: int | None, *,
              settle: bool) -> _Run:
    """Replay ``plan`` through one simulated allocator, step by step.

    With ``settle``, stop at the end of a step once at least
    :data:`DEFAULT_STEPS_MIN` micro-batches ran, the plan's longest
    micro-batch among them, and reserved memory has not grown over the last
    :data:`STEADY_WINDOW` micro-batches (compared with a step after the
    first).
    """
    from llmem_plugin.device.allocator import CachingAllocator, SimulatedOOM

    alloc = CachingAllocator(config, capacity_bytes=capacity)
    st = alloc.stats
    c = _Composer(model)
    handles: dict[int, int] = {}
    step_alloc: list[int] = []
    step_res: list[int] = []
    oom = False

    def feed(events) -> int:
        peak = st.allocated
        for sign, key, nbytes in events:
            if sign > 0:
                if nbytes > 0:
                    handles[key] = alloc.malloc(nbytes)
                    peak = max(peak, st.allocated)
            else:
                h = handles.pop(key, None)
                if h is not None:
                    alloc.free(h)
        return peak

    done: list[int] = []  # micro-batches replayed by the end of each step
    longest = max(max(lengths) for lengths in plan)
    # The run's longest micro-batch, however rare, shapes the cache: no steady state before it has run.
    first_longest = next(n for n, lengths in enumerate(plan) if max(lengths) == longest)
    try:
        feed(c.setup(plan[0][0]))
        for n, lengths in enumerate(plan):
            step_alloc.append(feed(c.step(n, lengths)))
            step_res.append(st.peak_reserved)
            done.append((done[-1] if done else 0) + len(lengths))
            if settle and done[-1] >= DEFAULT_STEPS_MIN and n >= first_longest:
                # Against the last step at least a window back, and never step 0 (the first iteration, which
                # creates the optimizer states): with a long accumulation a window is under one step.
                back = bisect.bisect_right(done, done[-1] - STEADY_WINDOW) - 1
                if 1 <= back < n and step_res[-1] == step_res[back]:
                    break
    except SimulatedOOM:
        oom = True
    return _Run(step_alloc, step_res, st.peak_allocated, st.peak_reserved, st.num_alloc_retries, oom)


def _check_repeatable(model: Piecewise, grad_accum_steps: int) -> None:
    """Each structure's second iteration must free what it allocates, except
    what escapes into a later segment of the same step; a micro-step
    segment repeated (long accumulation) must let nothing escape."""
    for _, _, der in model.regimes:
        roles = _roles(der.bounds, len(der.signs))
        step2 = [r for r in roles if r[2].startswith("2:")]
        lo = step2[0][0]
        earlier = {der.keys[i] for i in range(lo) if der.signs[i] > 0}
        live = set()
        for i in range(lo, len(der.signs)):
            if der.signs[i] > 0:
                live.add(der.keys[i])
            elif der.keys[i] in live:
                live.discard(der.keys[i])
            elif der.keys[i] in earlier:
                raise UnsupportedError("a training step frees an allocation the step before it made, so steps "
                                       "cannot be replayed one after another. HINT: estimate the longest length "
                                       "with --seq-len alone")
        if live:
            raise UnsupportedError(f"a training step keeps {len(live)} allocations of its own alive into the next, "
                                   "so steps cannot be replayed one after another. HINT: estimate the longest "
                                   "length with --seq-len alone")
        micro = (len(der.bounds) - 2) // 2
        if grad_accum_steps > micro and any(e[0] == f"2:m{micro - 1}" for e in der.escapes.values()):
            raise UnsupportedError("a later micro-step of the accumulation keeps allocations for the optimizer, so "
                                   "it cannot be repeated. HINT: estimate with --grad-accum 2 or less")


def estimate_variable_length(
    model: Any,
    workload: Any,
    lengths: str | Lengths,
    *,
    steps: int | None = None,
    seed: int = 0,
    fast: bool = False,
    gpu: Any = None,
    gpu_memory: int | str | None = None,
    alloc_conf: Any = None,
    torch_version: str | None = None,
) -> VarLenEstimate:
    """Replay a run whose micro-batches have lengths drawn from ``lengths`` (see the module doc).

    Args:
        model, workload, fast, gpu, gpu_memory, alloc_conf, torch_version: As
            for :func:`llmem_plugin.estimate`; ``workload.seq_len`` is the
            truncation length (the longest micro-batch).
        lengths: A :class:`Lengths` or its spelling (:func:`parse_lengths`).
        steps: Optimizer steps to replay; None: until reserved memory has not
            grown over :data:`STEADY_WINDOW` micro-batches (after at least
            :data:`DEFAULT_STEPS_MIN` micro-batches, at most :data:`MAX_STEPS`
            optimizer steps).
        seed: Seed of the sampler.

    Raises:
        ConfigError: Bad lengths or steps.
        UnsupportedError: The step's allocations cannot be derived across lengths.
    """
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.allocator import AllocatorConfig
    from llmem_plugin.estimate import uses_cublaslt
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.techniques import check_supported

    est = importlib.import_module("llmem_plugin.estimate")  # the package's `estimate` is the function
    dist = parse_lengths(lengths)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS):
        raise ConfigError(f"steps must be an integer in 1..{MAX_STEPS}, got {steps!r}. HINT: pass --steps N")
    est._check_source(model)
    from llmem_plugin.models.config import is_litgpt_source, num_layers

    if is_litgpt_source(model):
        raise UnsupportedError("--seq-lens with a litgpt model is not modelled (the derivation across lengths is "
                               "checked on transformers' models). HINT: estimate the longest length with --seq-len")
    wl = est._workload_from(workload, {})
    if wl.packed_docs is not None:
        raise UnsupportedError("--seq-lens with --packed-docs: packing fills every row to --batch-size x --seq-len "
                               "tokens, so its batches do not vary in length. HINT: drop one of the two")
    check_supported("single", wl)
    target = est._resolve_gpu(gpu, gpu_memory)
    config = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
              else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    meta = modelbuild.build_model(model, wl, device="meta")
    cfg = getattr(meta, "config", None)
    overheads = device_overheads(target.compute_capability, torch_version=torch_version,
                                 uses_cublaslt=uses_cublaslt(meta))
    micro = min(wl.grad_accum_steps, 2)
    ctx = {"gpu": target, "overheads": overheads, "micro": micro,
           "depth": num_layers(cfg) if cfg is not None else 0}

    n_plan = steps if steps is not None else MAX_STEPS
    plan = step_lengths(dist, micro_batch_size=wl.micro_batch_size, grad_accum_steps=wl.grad_accum_steps,
                        max_len=wl.seq_len, steps=n_plan, seed=seed)
    needed = sorted({s for step in plan for s in step})
    model_ = piecewise(needed, lambda s: _trace_at(model, wl, s, fast=fast, ctx=ctx))
    _check_repeatable(model_, wl.grad_accum_steps)

    capacity = target.capacity_bytes
    room = max(capacity - overheads.outside_allocator_bytes, 0)

    free = _simulate(model_, plan, config, None, settle=steps is None)
    n = len(free.step_allocated)
    plan = plan[:n]
    result, fits = free, True
    if free.peak_reserved > room:  # at capacity the allocator frees its cache and retries
        capped = _simulate(model_, plan, config, room, settle=False)
        fits = not capped.oom
        if fits:
            result = capped
    alloc, reserved = result.step_allocated, result.step_reserved
    grew = [i for i in range(1, n) if reserved[i] > reserved[i - 1]]
    warmup = (grew[-1] + 1) if grew else 1
    longest = max(s for step in plan for s in step)
    fixed = _simulate(model_, [[longest] * wl.grad_accum_steps] * min(n, 3), config, None, settle=False)
    worst = max(range(n), key=lambda i: alloc[i])
    return VarLenEstimate(
        lengths=dist, steps=n, warmup_steps=warmup, step_lengths=plan,
        peak_allocated_bytes=result.peak_allocated, peak_reserved_bytes=result.peak_reserved,
        reserved_after_warmup_bytes=reserved[warmup - 1], worst_step=worst,
        step_allocated_bytes=alloc, step_reserved_bytes=reserved,
        fixed_allocated_bytes=fixed.peak_allocated, fixed_reserved_bytes=fixed.peak_reserved,
        device_total_bytes=result.peak_reserved + overheads.outside_allocator_bytes,
        capacity_bytes=capacity, fits=fits, alloc_retries=result.retries, derivation=model_,
    )
