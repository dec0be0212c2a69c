"""A predicted and a real memory snapshot side by side: where they part, and what that means.

:func:`compare_snapshots` reads both histories (:mod:`llmem_plugin.snapshot.history`),

1. reports each one's peak allocated and reserved bytes;
2. aligns the two streams of allocations and frees (as ``(action, block
   bytes)`` tokens, in one pass that resynchronises within
   :data:`RESYNC_WINDOW` tokens) and finds the first aligned point where the
   allocated bytes differ by more than a threshold;
3. lists what is live at one peak and not at the other, grouped by what made
   it: the predicted side by its category, module and op (the frames
   :mod:`~llmem_plugin.snapshot.predict` writes), the real side by its first
   stack frame outside PyTorch (when the run recorded stacks) or its size;
4. says in one line what the difference means, from the sizes alone: the
   same allocations scaled by one factor (the batch or the sequence differs),
   or 32-bit copies of 16-bit tensors on the loss path (the loss upcasts
   differently), or, failing both, how many bytes of which allocations.

Known limitations:
    * A difference that moves an allocation more than :data:`RESYNC_WINDOW`
      tokens leaves it unpaired; the divergence is then found where the bytes part.
    * One device of each snapshot is read: the one with a history (a rank's own file).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.snapshot.history import Allocation, History, read_history

__all__ = ["Comparison", "Divergence", "LiveGroup", "RESYNC_WINDOW", "compare_snapshots"]

# How far ahead, in allocations and frees, a difference may be resolved: the traced and the real
# stream of the stub's cases reorder events only a few apart (benchmarks/results/snapshot-stub-2026-12-07.md,
# and benchmarks/groundtruth/stub_diff.py's --window default of 64 for a reordering).
RESYNC_WINDOW = 64
# Ratio between a 32-bit tensor and the 16-bit one it was cast from (4 B / 2 B per element).
_UPCAST = 2.0
# Ops of the loss path: the cross-entropy over the logits and its backward (torch.nn.functional.cross_entropy
# is log_softmax then nll_loss; liger and chunked losses run logsumexp). A cast (_to_copy) counts only outside
# every submodule, where transformers' loss_function upcasts the logits.
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")
_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LiveGroup:
    """Allocations live at one side's peak with no counterpart of their size at the other's."""

    label: str
    count: int
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "count": self.count, "bytes": self.nbytes}


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first aligned point where the allocated bytes differ by more than the threshold."""

    predicted_entry: int
    real_entry: int
    predicted_bytes: int
    real_bytes: int
    near: str  # what the history allocated there (the predicted side's label)

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_entry": self.predicted_entry, "real_entry": self.real_entry,
                "predicted_bytes": self.predicted_bytes, "real_bytes": self.real_bytes, "near": self.near}


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """What :func:`compare_snapshots` found.

    Attributes:
        predicted_peak_allocated_bytes, real_peak_allocated_bytes: Peak allocated in each history.
        predicted_peak_reserved_bytes, real_peak_reserved_bytes: Peak reserved in each history.
        num_predicted_tokens, num_real_tokens: Allocations and frees in each history.
        num_matched_tokens: Of those, how many the alignment pairs.
        divergence: The first point the two part by more than ``threshold_bytes``; None if they never do.
        threshold_bytes: The threshold used.
        predicted_only: Live at the predicted peak, not at the real one (largest first).
        real_only: Live at the real peak, not at the predicted one (largest first).
        meaning: One line on what the difference means.
    """

    predicted_peak_allocated_bytes: int
    real_peak_allocated_bytes: int
    predicted_peak_reserved_bytes: int
    real_peak_reserved_bytes: int
    num_predicted_tokens: int
    num_real_tokens: int
    num_matched_tokens: int
    divergence: Divergence | None
    threshold_bytes: int
    predicted_only: list[LiveGroup] = field(default_factory=list)
    real_only: list[LiveGroup] = field(default_factory=list)
    meaning: str = ""

    @property
    def peak_error(self) -> float:
        """(predicted - real) / real of the allocated peaks (negative: the prediction is under)."""
        real = self.real_peak_allocated_bytes
        return (self.predicted_peak_allocated_bytes - real) / real if real else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_peak_allocated_bytes": self.predicted_peak_allocated_bytes,
            "real_peak_allocated_bytes": self.real_peak_allocated_bytes,
            "predicted_peak_reserved_bytes": self.predicted_peak_reserved_bytes,
            "real_peak_reserved_bytes": self.real_peak_reserved_bytes,
            "peak_error": round(self.peak_error, 6),
            "num_predicted_tokens": self.num_predicted_tokens, "num_real_tokens": self.num_real_tokens,
            "num_matched_tokens": self.num_matched_tokens,
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
            "threshold_bytes": self.threshold_bytes,
            "predicted_only": [g.to_dict() for g in self.predicted_only],
            "real_only": [g.to_dict() for g in self.real_only],
            "meaning": self.meaning,
        }


def compare_snapshots(predicted: dict[str, Any], real: dict[str, Any], *, threshold: float = 0.01,
                      device: int | None = None) -> Comparison:
    """Compare a predicted snapshot with a real one.

    Args:
        predicted: The predicted snapshot (``llmem estimate --snapshot``), or any snapshot taken as the reference.
        real: The real run's snapshot (``torch.cuda.memory._dump_snapshot``).
        threshold: The divergence threshold, as a fraction of the larger allocated peak (at least 1 MiB).
        device: The device trace read from each (default: each one's single device with a history).

    Raises:
        ConfigError: A snapshot without an allocator history.
    """
    hp, hr = read_history(predicted, device), read_history(real, device)
    peak = max(hp.peak_allocated_bytes, hr.peak_allocated_bytes)
    limit = max(int(threshold * peak), _MIB)
    tp, tr = _tokens(hp), _tokens(hr)
    pairs = _align([t for t, _ in tp], [t for t, _ in tr])
    divergence = _first_divergence(hp, hr, tp, tr, pairs, limit)
    pred_only, real_only = _live_difference(hp, hr)
    wl = (predicted.get("llmem") or {}).get("workload") or {}
    return Comparison(
        predicted_peak_allocated_bytes=hp.peak_allocated_bytes, real_peak_allocated_bytes=hr.peak_allocated_bytes,
        predicted_peak_reserved_bytes=hp.peak_reserved_bytes, real_peak_reserved_bytes=hr.peak_reserved_bytes,
        num_predicted_tokens=len(tp), num_real_tokens=len(tr), num_matched_tokens=len(pairs),
        divergence=divergence, threshold_bytes=limit,
        predicted_only=_groups(pred_only), real_only=_groups(real_only),
        meaning=_meaning(hp, hr, pred_only, real_only, wl, limit),
    )


def _tokens(h: History) -> list[tuple[tuple[str, int], int]]:
    """``((action, block bytes), entry)`` for every alloc and completed free."""
    out = []
    for n, e in enumerate(h.entries):
        if e["action"] in ("alloc", "free_completed"):
            out.append(((e["action"], max(512, -(-e["size"] // 512) * 512)), n))
    return out


def _align(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` of equal tokens, in order, in one pass: equal tokens pair; at a difference,
    the nearest equal pair within :data:`RESYNC_WINDOW` tokens ahead on both sides (fewest tokens skipped)
    resumes the pairing, and where there is none, one token of each is left unpaired. Linear in the
    lengths (SequenceMatcher took 15 s on two 37,000-entry histories of an 8B step)."""
    pairs: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
            continue
        ahead: dict[tuple[str, int], int] = {}
        for dl, tok in enumerate(b[j:j + RESYNC_WINDOW]):
            ahead.setdefault(tok, dl)
        best = None
        for dk, tok in enumerate(a[i:i + RESYNC_WINDOW]):
            dl = ahead.get(tok)
            if dl is not None and (best is None or dk + dl < sum(best)):
                best = (dk, dl)
            if best is not None and dk >= sum(best):
                break
        if best is None:
            i, j = i + 1, j + 1
        else:
            i, j = i + best[0], j + best[1]
    return pairs


def _first_divergence(hp: History, hr: History, tp: list, tr: list, pairs: list[tuple[int, int]],
                      limit: int) -> Divergence | None:
    for i, j in pairs:
        ep, er = tp[i][1], tr[j][1]
        a, b = hp.allocated[ep], hr.allocated[er]
        if abs(a - b) > limit:
            return Divergence(predicted_entry=ep, real_entry=er, predicted_bytes=a, real_bytes=b,
                              near=_label(_allocation_at(hp, ep)))
    return None


def _allocation_at(h: History, entry: int) -> Allocation | None:
    """The allocation made at ``entry``, or the last one made before it."""
    best = None
    for a in h.allocations:
        if a.start > entry:
            break
        best = a
    return best


def _live_difference(hp: History, hr: History) -> tuple[list[Allocation], list[Allocation]]:
    """Allocations live at each peak whose size the other side's peak does not hold as often."""
    lp, lr = hp.live_at(hp.peak_entry), hr.live_at(hr.peak_entry)
    extra_p = Counter(a.size for a in lp) - Counter(a.size for a in lr)
    extra_r = Counter(a.size for a in lr) - Counter(a.size for a in lp)

    def pick(live: list[Allocation], extra: Counter) -> list[Allocation]:
        out = []
        for a in reversed(live):  # the newest of each size: what the peak added last
            if extra[a.size] > 0:
                extra[a.size] -= 1
                out.append(a)
        return out

    return pick(lp, extra_p), pick(lr, extra_r)


def _label(a: Allocation | None) -> str:
    """What made ``a``: category, module and op (predicted frames), or the first frame outside torch."""
    if a is None:
        return "before the history"
    if a.category is not None and a.frames:
        op, where = a.frames[0]["name"], a.frames[0]["filename"]
        return f"{a.category}: {op} in {where}"
    for f in a.frames:  # the innermost Python frame outside torch (stacks="all" interleaves C++ frames)
        name = f.get("filename", "")
        if name.endswith(".py") and "/torch/" not in name:
            return f"{name}:{f.get('line', 0)} {f.get('name', '')}"
    return f"{_size(a.size)} allocation (no stack recorded)"


def _groups(allocs: list[Allocation]) -> list[LiveGroup]:
    by: dict[str, list[int]] = {}
    for a in allocs:
        by.setdefault(_label(a), []).append(a.size)
    groups = [LiveGroup(label=k, count=len(v), nbytes=sum(v)) for k, v in by.items()]
    return sorted(groups, key=lambda g: -g.nbytes)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _meaning(hp: History, hr: History, pred_only: list[Allocation], real_only: list[Allocation],
             workload: dict[str, Any], limit: int) -> str:
    """One line: what the difference at the peaks means (after what ran out of memory, if either did)."""
    oom = _oom_line(hp, hr)
    body = _difference_line(hp, hr, pred_only, real_only, workload, limit)
    return f"{oom}; {body}" if oom else body


def _oom_line(hp: History, hr: History) -> str:
    def at(h: History) -> str:
        return f"asking for {_size(h.oom_bytes)} with {_size(h.allocated[h.oom_entry])} allocated"

    if hp.oom_entry >= 0 and hr.oom_entry >= 0:
        return f"both run out of memory: the prediction {at(hp)}, the real run {at(hr)}"
    if hr.oom_entry >= 0:
        return f"the real run ran out of memory {at(hr)}, where the prediction fits (peak {_size(hp.peak_allocated_bytes)})"
    if hp.oom_entry >= 0:
        return f"the prediction runs out of memory {at(hp)}; the real run did not"
    return ""


def _difference_line(hp: History, hr: History, pred_only: list[Allocation], real_only: list[Allocation],
                     workload: dict[str, Any], limit: int) -> str:
    diff = hr.peak_allocated_bytes - hp.peak_allocated_bytes
    agree = (f"the peaks agree within {_size(limit)}: {_size(hp.peak_allocated_bytes)} predicted, "
             f"{_size(hr.peak_allocated_bytes)} real; ")
    if abs(diff) <= limit and not pred_only and not real_only:
        return agree + "the same allocations live at each"
    line = _upcast_line(pred_only, real_only, workload) or _scaled_line(hp, pred_only, real_only, workload)
    if line:
        return line
    if abs(diff) <= limit:
        return agree + f"{len(pred_only)} predicted and {len(real_only)} real allocations live at one peak only"
    side, allocs = ("real run", real_only) if diff > 0 else ("prediction", pred_only)
    top = _groups(allocs)[:1]
    what = f": mostly {top[0].count} x {_size(top[0].nbytes // max(top[0].count, 1))} ({top[0].label})" if top else ""
    return f"the {side} peaks {_size(abs(diff))} higher{what}"


def _upcast_line(pred_only: list[Allocation], real_only: list[Allocation], workload: dict[str, Any]) -> str:
    """A few 32-bit copies of predicted 16-bit loss-path tensors (or the reverse): the loss path differs."""
    for extra, other, side in ((real_only, pred_only, "real"), (pred_only, real_only, "predicted")):
        if not extra or len(extra) > 4:
            continue
        halves = Counter(a.size for a in other)
        matched = [a for a in extra if halves.get(a.size // 2)]
        if len(matched) != len(extra):
            continue
        # The predicted side says what the tensors are: the 16-bit sources, or the fp32 copies themselves.
        sources = [b for b in other if b.size * _UPCAST in {a.size for a in matched}]
        if not any(_on_loss_path(b) for b in (sources if side == "real" else matched)):
            continue
        size = _size(matched[0].size)
        loss = workload.get("loss", "hf")
        if side == "real":
            hint = "try --loss hf (the fp32 upcast of the logits)" if loss != "hf" else \
                "the real run upcasts where the modelled loss does not; check the loss the job runs"
            return (f"the real run holds {len(matched)} more {size} allocation(s), twice the predicted 16-bit "
                    f"loss-path tensors (fp32 copies of 16-bit logits): the loss path differs; {hint}")
        hint = "try --loss no-upcast" if loss == "hf" else "check the loss the job runs"
        return (f"the prediction holds {len(matched)} more {size} allocation(s), fp32 copies of 16-bit loss-path "
                f"tensors the real run does not make: the loss path differs; {hint}")
    return ""


def _on_loss_path(a: Allocation) -> bool:
    """A predicted allocation made by the loss (its frames: :mod:`llmem_plugin.snapshot.predict`)."""
    if a.category is None or not a.frames:
        return False
    op, where = a.frames[0].get("name", ""), a.frames[0].get("filename", "")
    return any(k in op for k in _LOSS_OPS) or ("_to_copy" in op and where == "<step>")


def _scaled_line(hp: History, pred_only: list[Allocation], real_only: list[Allocation],
                 workload: dict[str, Any]) -> str:
    """The same allocations on both sides, scaled by one factor: the batch or the sequence length differs.
    A batch or a length changes every activation: the scaled ones must be most of the predicted peak's
    activations and temporaries, not a few tensors of one op that happen to have such a ratio."""
    if not pred_only or not real_only:
        return ""
    ratio = max(a.size for a in real_only) / max(a.size for a in pred_only)
    if abs(ratio - 1.0) < 0.05:
        return ""
    sizes_p, sizes_r = Counter(a.size for a in pred_only), Counter(a.size for a in real_only)
    covered_r = [a for a in real_only if sizes_p.get(round(a.size / ratio))]
    covered_p = [a for a in pred_only if sizes_r.get(round(a.size * ratio))]
    # One factor has to explain most of both sides, over several allocations: one odd tensor is no scaling.
    if len(covered_r) < 3 or sum(a.size for a in covered_r) < 0.5 * sum(a.size for a in real_only) \
            or sum(a.size for a in covered_p) < 0.5 * sum(a.size for a in pred_only):
        return ""
    # A third, not all: some scaled tensors land on sizes the other side also holds and cancel out.
    acts = sum(a.size for a in hp.live_at(hp.peak_entry) if a.category in ("activations", "temporaries"))
    if sum(a.size for a in covered_p) < acts / 3:
        return ""
    seq, batch = workload.get("seq_len"), workload.get("micro_batch_size")
    shape = f" (predicted: batch {batch} x {seq} tokens)" if seq and batch else ""
    return (f"the real run's activations are {ratio:.2g}x the predicted ones{shape}: the batch size or the "
            f"sequence length differs; estimate with the job's --batch-size and --seq-len")
