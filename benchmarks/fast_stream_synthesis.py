"""Prototype: the full-depth allocator event stream synthesized from a
shortened trace, replayed through the allocator simulation.

Fast mode (llmem_plugin/fast.py) extrapolates each phase's peaks affinely in
depth. That is exact for tensor and allocated bytes, not for the allocator's
reserved bytes. Here the event stream of the full model is built from the
stream of a copy with fewer layers, and replayed:

1. A :class:`MemoryTracker` subclass tags every record with the decoder layer
   it belongs to (forward: the module running when it is allocated; backward:
   the module whose gradient hook fired last, or the recomputed forward under
   gradient checkpointing (the library's tracker clears a stopped
   recomputation's module stack when a gradient hook fires); optimizer: the layer of the parameter the foreach
   op's list element (or the single-tensor op's input) belongs to; the
   parameters registered at setup: their name), and every event with the
   layer whose code runs it (its "segment": the running layer in forward and
   backward, the record's layer in setup and optimizer).
2. Records are keyed by (layer, ordinal among that layer's records); global
   records (embeddings, head, loss, inputs) by their own index.
3. Every maximal run of events whose segment is a template layer ``k`` of the
   shorter copy is followed (layers ascending: forward, optimizer, setup) or
   preceded (descending: backward) by ``D`` copies of itself in which a
   record of layer ``L`` becomes layer ``j + L - k`` for copy ``j``; the copy's
   layers above ``k`` are renumbered ``+D``. A neighbour's record (the
   residual made by layer ``k - 1`` and freed in layer ``k``) so becomes copy
   ``j - 1``'s.
4. The synthesized stream is compared with the deeper trace's stream event by
   event (sign, bytes, and which earlier allocation a free releases) and both
   are replayed with the cuBLAS workspaces (estimate.allocator_events).

    python benchmarks/fast_stream_synthesis.py            # every config
    python benchmarks/fast_stream_synthesis.py llama ...  # some of them
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from llmem_plugin import _pause, modelbuild
from llmem_plugin.allocator import AllocatorConfig, replay
from llmem_plugin.estimate import DEFAULT_GPU, _extrapolated_simulation, _trace, allocator_events, uses_cublaslt
from llmem_plugin.fast import Extrapolation
from llmem_plugin.gpus import get_gpu
from llmem_plugin.layerkinds import layer_kinds, plan_layers, shortened_config
from llmem_plugin.overheads import device_overheads
from llmem_plugin.tracker import MemoryCategory, MemoryTracker, Phase, TraceResult, _tensors_in
from llmem_plugin.workload import LoraSpec, OptimizerKind, Precision, Runner, Workload

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")
_UNSET = object()


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name or "")
    return int(m.group(1)) if m else None


class LayerTracker(MemoryTracker):
    """Tags records and events with a decoder layer (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.rec_layer: list[int | None] = []
        self.ev_seg: list[int | None] = []
        self._param_layer: dict[int, int | None] = {}
        self._override: Any = _UNSET
        self._opt_running: int | None = None

    def watch_modules(self, model: torch.nn.Module) -> None:
        super().watch_modules(model)
        for name, p in model.named_parameters():
            self._param_layer[id(p)] = layer_of(name)
        for name, b in model.named_buffers():
            self._param_layer[id(b)] = layer_of(name)

    def register(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        for t in tensors:
            self._override = self._param_layer.get(id(t))
            self._see(t.untyped_storage(), category)
        self._override = _UNSET
        self.label(tensors, category)

    def _context_layer(self) -> int | None:
        return layer_of(self.current_module)

    def _layer_of_tensor(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return _UNSET
        idx = self._live.get(id(t.untyped_storage()))
        return None if idx is None else self.rec_layer[idx]

    def _optimizer_tags(self, args: tuple, kwargs: dict, outs: list[torch.Tensor], out: Any) -> list[Any]:
        flat_args = [*args, *(kwargs or {}).values()]
        if isinstance(out, (list, tuple)) and len(out) == len(outs):
            for a in flat_args:
                if isinstance(a, (list, tuple)) and len(a) == len(outs) and all(isinstance(x, torch.Tensor) for x in a):
                    return [self._layer_of_tensor(x) for x in a]
        tags = set()
        for a in flat_args:
            for x in (a if isinstance(a, (list, tuple)) else [a]):
                tag = self._layer_of_tensor(x)
                if tag is not _UNSET:
                    tags.add(tag)
        one = tags.pop() if len(tags) == 1 else None
        return [one] * len(outs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs)
        if not _pause.is_paused():
            outs = list(_tensors_in(out))
            tags = self._optimizer_tags(args, kwargs, outs, out) if self.phase is Phase.OPTIMIZER else [_UNSET] * len(outs)
            # The layer a per-parameter optimizer loop is at (torch.optim's
            # foreach=False): a temporary of the previous parameter is freed
            # when its variable is rebound, after this op's output.
            one = len(outs) == 1 and not isinstance(out, (list, tuple))
            self._opt_running = tags[0] if one and self.phase is Phase.OPTIMIZER else None
            for t, tag in zip(outs, tags):
                self._override = tag
                self._see(t.untyped_storage(), MemoryCategory.TEMPORARY)
            self._override = _UNSET
        return out

    def _see(self, storage: torch.UntypedStorage, category: MemoryCategory) -> None:
        n = len(self._records)
        super()._see(storage, category)
        if len(self._records) > n:
            tag = self._context_layer() if self._override is _UNSET else self._override
            self.rec_layer.append(tag)
            self.ev_seg.append(tag)  # an allocation runs in its record's layer

    def _free(self, key: int) -> None:
        idx = self._live[key]
        seg = self._context_layer() if self.phase in (Phase.FORWARD, Phase.BACKWARD) else self._opt_running
        if seg is None:
            # Outside any layer (the optimizer, the autocast cache freed at the
            # end of the forward): frees come layer by layer, in the record's.
            seg = self.rec_layer[idx]
        super()._free(key)
        self.ev_seg.append(seg)


def unit_map(prefix: int, period: int, units: int):
    """Layer -> (unit, layer's place in its unit) in a copy with ``units``
    periods: the prefix's and the suffix's layers are units of their own."""
    def f(layer: int | None) -> tuple[int | None, int]:
        if layer is None:
            return None, 0
        if layer < prefix:
            return layer, 0
        if layer < prefix + units * period:
            return prefix + (layer - prefix) // period, (layer - prefix) % period
        return prefix + units + (layer - prefix - units * period), 0
    return f


def device_stream(tr: LayerTracker, unit_of=None) -> dict:
    """The tracker's device events (HOST records dropped, as ``result()`` does)
    with their segment, phase, and the marks at device-event positions;
    layers become units (periods) with ``unit_of`` (see :func:`unit_map`)."""
    unit_of = unit_of or (lambda layer: (layer, 0))
    at_event = {i: name for name, i in tr._marks.items()}
    ev, seg, ph, marks = [], [], [], {}
    for i, ((sign, idx), phase) in enumerate(zip(tr._events, tr._phase_of_event)):
        if i in at_event:
            marks[at_event[i]] = len(ev)
        rec = tr._records[idx]
        if rec.category is MemoryCategory.HOST:
            continue
        ev.append((sign, idx, rec.nbytes))
        seg.append(unit_of(tr.ev_seg[i])[0])
        ph.append(phase)
    for name, i in tr._marks.items():
        marks.setdefault(name, len(ev))
    units = [unit_of(layer) for layer in tr.rec_layer]
    return dict(events=ev, seg=seg, phase=ph, marks=marks, rec_layer=[u for u, _ in units],
                rec_module=[_LAYER.sub(f".#{off}.", r.module) for r, (_, off) in zip(tr._records, units)],
                rec_phase=[r.phase.value for r in tr._records],
                rec_nbytes=[r.nbytes for r in tr._records])


def synthesize(s: dict, k: int, d: int) -> tuple[dict, dict]:
    """``s`` with ``d`` copies of layer ``k`` inserted after it (see the module docstring)."""
    rec_layer = s["rec_layer"]
    # A record's role in its layer: the module (layer number taken out), the
    # phase, the bytes, and how many records of the layer had these before.
    # The first and last layers make a few records the others do not (LoRA:
    # the first layer's input needs no gradient), so a plain ordinal would
    # not match a neighbour's record with the template's.
    ordinal: dict[int, tuple] = {}
    seen: dict[tuple, int] = {}
    for r, lay in enumerate(rec_layer):
        sig = (lay, s["rec_module"][r], s["rec_phase"][r], s["rec_nbytes"][r])
        ordinal[r] = (*sig[1:], seen.get(sig, 0))
        seen[sig] = seen.get(sig, 0) + 1

    def full_layer(lay: int) -> int:
        return lay if lay <= k else lay + d

    def key(r: int, copy_of: int | None, at: int | None = None) -> tuple:
        # ``at``: the segment (layer) of the event that references the record.
        # A reference keeps its distance to the running layer: layer k + 1's
        # free of layer k's residual becomes layer k + 1 + d's free of the
        # last copy's.
        lay = rec_layer[r]
        if lay is None:
            return ("g", r)
        if copy_of is None:
            if at is None:
                return (full_layer(lay), ordinal[r])
            return (full_layer(at) + lay - at, ordinal[r])
        return (copy_of + lay - k, ordinal[r])

    ev, seg, ph = s["events"], s["seg"], s["phase"]
    runs: list[tuple[int, int]] = []  # [start, end) of maximal same-segment runs
    i = 0
    while i < len(ev):
        j = i
        while j < len(ev) and seg[j] == seg[i]:
            j += 1
        runs.append((i, j))
        i = j
    out, out_ph, pos = [], [], {}
    stats = dict(template_runs=0, ascending=0, descending=0, unknown=0, global_frees_moved=0)
    prev_layer_seg: int | None = None

    def emit(a: int, b: int, copy_of: int | None, deferred: list) -> None:
        for e in range(a, b):
            sign, r, nb = ev[e]
            if copy_of is None and e not in pos:
                pos[e] = len(out)
            if rec_layer[r] is None and sign < 0 and seg[e] == k:
                # A global record freed inside the template layer: the last
                # copy in stream order frees it.
                if copy_of is None:
                    deferred.append(e)
                    continue
                continue
            if rec_layer[r] is None and sign > 0 and copy_of is not None:
                continue
            out.append((sign, key(r, copy_of, seg[e]), nb))
            out_ph.append(ph[e])

    for a, b in runs:
        sg = seg[a]
        if sg != k:
            emit(a, b, None, [])
            if sg is not None:
                prev_layer_seg = sg
            continue
        stats["template_runs"] += 1
        # Direction: the next layer segment after this run.
        nxt = next((seg[x] for x, _ in runs if x >= b and seg[x] is not None and seg[x] != k), None)
        descending = prev_layer_seg == k + 1 or (prev_layer_seg != k - 1 and nxt == k - 1)
        if prev_layer_seg not in (k - 1, k + 1) and nxt not in (k - 1, k + 1):
            stats["unknown"] += 1
        deferred: list[int] = []
        if descending:
            stats["descending"] += 1
            for j in range(k + d, k, -1):
                emit(a, b, j, [])
            emit(a, b, None, deferred)
        else:
            stats["ascending"] += 1
            emit(a, b, None, deferred)
            for j in range(k + 1, k + d + 1):
                emit(a, b, j, [])
        for e in deferred:
            stats["global_frees_moved"] += 1
            sign, r, nb = ev[e]
            out.append((sign, key(r, None), nb))
            out_ph.append(ph[e])
        prev_layer_seg = k
    ids: dict[tuple, int] = {}
    events = [(sign, ids.setdefault(kk, len(ids)), nb) for sign, kk, nb in out]
    marks = {name: (pos.get(p, len(out)) if p < len(ev) else len(out)) for name, p in s["marks"].items()}
    return dict(events=events, phase=out_ph, marks=marks), stats


def diff_synthesis(short: dict, long: dict, d: int) -> tuple[list[tuple[int, int]], dict]:
    """The other route: diff the two copies' (sign, bytes) sequences and repeat
    every chunk the longer one inserts ``d`` times. It gives no free's
    allocation (a replay needs one), only the sequence to compare."""
    import difflib

    a = [(e[0], e[2]) for e in short["events"]]
    b = [(e[0], e[2]) for e in long["events"]]
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    out: list[tuple[int, int]] = []
    kinds: dict[str, int] = {}
    for tag, i1, i2, j1, j2 in ops:
        kinds[tag] = kinds.get(tag, 0) + 1
        if tag == "equal":
            out += a[i1:i2]
        elif tag == "insert":
            out += b[j1:j2] * d
        else:
            out += b[j1:j2]  # a replace or delete: not a repetition (counted in kinds)
    return out, kinds


def canonical(events: list[tuple[int, Any, int]]) -> list[tuple[int, int, int]]:
    """(sign, bytes, index of the allocation event a free releases): two streams
    with equal canonical forms replay identically."""
    born: dict[Any, int] = {}
    out = []
    for i, (sign, key, nb) in enumerate(events):
        if sign > 0:
            born[key] = i
            out.append((1, nb, i))
        else:
            out.append((-1, nb, born.get(key, -1)))
    return out


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def as_trace(s: dict) -> TraceResult:
    ev = s["events"]
    return TraceResult(peak_bytes=0, peak_phase=Phase.SETUP, peak_module="", breakdown={}, phase_peaks={},
                       phase_breakdowns={}, timeline=[(i, p, 0) for i, p in enumerate(s["phase"])],
                       num_events=len(ev), events=ev, marks=s["marks"])


def simulate(s: dict, config: AllocatorConfig, overheads: Any):
    events, phases = allocator_events(as_trace(s), overheads)
    return replay(events, config, labels=phases)


def traced(config: Any, workload: Workload) -> tuple[LayerTracker, TraceResult, float]:
    tr = LayerTracker()
    t0 = time.perf_counter()
    res = _trace(modelbuild.build_model(config, workload), workload, get_gpu(DEFAULT_GPU), tracker=tr)
    return tr, res, time.perf_counter() - t0


def configs() -> dict[str, tuple[Any, Workload]]:
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig

    llama = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                        tie_word_embeddings=False)
    gpt2 = GPT2Config(vocab_size=8000, n_embd=512, n_layer=12, n_head=8, n_positions=1024)
    wide = LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                       tie_word_embeddings=False)
    gemma = Gemma3TextConfig(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=24,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=64,
                             sliding_window_pattern=3, max_position_embeddings=1024)
    wl = Workload(seq_len=256)
    return {
        "llama": (llama, wl),
        "llama16": (replace_layers(llama, 16), wl),
        "gpt2": (gpt2, wl),
        "llama-ckpt": (llama, replace(wl, grad_checkpointing=True)),
        "llama-lora": (llama, replace(wl, lora=LoraSpec(rank=16))),
        "llama-accum2": (llama, replace(wl, grad_accum_steps=2)),
        "llama-hf": (llama, replace(wl, runner=Runner.HF_TRAINER)),
        "llama-forloop": (llama, replace(wl, optimizer=OptimizerKind.ADAMW_FORLOOP)),
        "llama-adafactor": (llama, replace(wl, optimizer=OptimizerKind.ADAFACTOR)),
        "llama-fp32": (llama, replace(wl, precision=Precision.FP32)),
        "llama-wide": (wide, replace(wl, seq_len=512)),
        # Period 3 (two sliding-window layers, one global), 24 and 23 layers.
        "gemma3-p3": (gemma, wl),
        "gemma3-p3-suffix": (replace_layers(gemma, 23), wl),
    }


def replace_layers(config: Any, n: int) -> Any:
    import copy

    c = copy.deepcopy(config)
    c.num_hidden_layers = n
    if getattr(c, "layer_types", None):
        c.layer_types = c.layer_types[:n]
    return c


def pct(x: int, ref: int) -> str:
    return f"{100.0 * (x - ref) / ref:+.2f}%" if ref else "n/a"


def run_one(name: str, config: Any, workload: Workload) -> None:
    kinds, reason = layer_kinds(config)
    plan = plan_layers(kinds)
    assert plan is not None, "no shorter copy to trace"
    n = plan.num_layers
    alloc_conf = AllocatorConfig.from_env("")
    probe = modelbuild.build_model(config, workload)
    overheads = device_overheads(get_gpu(DEFAULT_GPU).compute_capability, uses_cublaslt=uses_cublaslt(probe))
    del probe
    c_short = shortened_config(config, plan.indices(plan.traced), kinds)
    c_long = shortened_config(config, plan.indices(plan.traced + 1), kinds)
    t_full, r_full, s_full = traced(config, workload)
    t_short, r_short, s_short = traced(c_short, workload)
    t_long, r_long, s_long = traced(c_long, workload)
    units = {"full": plan.repeats, "short": plan.traced, "long": plan.traced + 1}
    tracers = {"full": t_full, "short": t_short, "long": t_long}
    streams = {lab: device_stream(t, unit_map(plan.prefix, plan.period, units[lab])) for lab, t in tracers.items()}
    sim_full = simulate(streams["full"], alloc_conf, overheads)
    sim_long = simulate(streams["long"], alloc_conf, overheads)
    ext = Extrapolation(None, r_short, r_long, plan.repeats - plan.traced, plan)
    affine = _extrapolated_simulation(ext, alloc_conf, overheads)
    print(f"## {name}: {n} layers = prefix {plan.prefix} + {plan.repeats} x {plan.period} + suffix {plan.suffix}; "
          f"short {plan.short_layers}, long {plan.long_layers} layers; "
          f"trace s: full {s_full:.1f}, short {s_short:.1f}, long {s_long:.1f}; events full {len(streams['full']['events'])}")
    print(f"  full replay: allocated {sim_full.peak_allocated_bytes}, reserved {sim_full.peak_reserved_bytes}")
    print(f"  affine fast mode: allocated {affine.peak_allocated_bytes} ({pct(affine.peak_allocated_bytes, sim_full.peak_allocated_bytes)}), "
          f"reserved {affine.peak_reserved_bytes} ({pct(affine.peak_reserved_bytes, sim_full.peak_reserved_bytes)})")
    for src, dst in (("short", "long"), ("short", "full")):
        t0 = time.perf_counter()
        seq, kinds_ = diff_synthesis(streams[src], streams["long"], units[dst] - units[src])
        want = [(e[0], e[2]) for e in streams[dst]["events"]]
        diff = first_difference(seq, want)
        print(f"  sequence diff {src}->{dst}: opcodes {kinds_}, {time.perf_counter() - t0:.2f} s; (sign, bytes) sequence "
              + ("identical" if diff is None else f"first differs at event {diff}/{len(want)} ({len(seq)} synthesized)"))
    cases = [("short->long", "short", "long", sim_long), ("long->full", "long", "full", sim_full),
             ("short->full", "short", "full", sim_full)]
    for label, src, dst, sim_ref in cases:
        # Template: a unit of the body with a unit before it.
        for k in range(max(plan.prefix, 1), plan.prefix + units[src]):
            t0 = time.perf_counter()
            syn, stats = synthesize(streams[src], k, units[dst] - units[src])
            t_syn = time.perf_counter() - t0
            t0 = time.perf_counter()
            sim = simulate(syn, alloc_conf, overheads)
            t_rep = time.perf_counter() - t0
            a, b = canonical(syn["events"]), canonical(streams[dst]["events"])
            diff = first_difference(a, b)
            where = "identical"
            if diff is not None:
                ref = streams[dst]
                ph = ref["phase"][diff].value if diff < len(ref["phase"]) else "end"
                sg = ref["seg"][diff] if diff < len(ref["seg"]) else None
                where = (f"first differs at event {diff}/{len(b)} (phase {ph}, segment layer {sg}): "
                         f"synth {a[diff] if diff < len(a) else None} vs real {b[diff] if diff < len(b) else None}; "
                         f"synth {len(a)} events; (sign,bytes) multiset equal: "
                         f"{sorted(x[:2] for x in a) == sorted(x[:2] for x in b)}")
            print(f"  {label} template k={k}: allocated {sim.peak_allocated_bytes} ({pct(sim.peak_allocated_bytes, sim_ref.peak_allocated_bytes)}), "
                  f"reserved {sim.peak_reserved_bytes} ({pct(sim.peak_reserved_bytes, sim_ref.peak_reserved_bytes)}); "
                  f"synth {t_syn:.2f} s + replay {t_rep:.2f} s; runs {stats}; stream: {where}")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    all_configs = configs()
    for name in argv or list(all_configs):
        config, workload = all_configs[name]
        run_one(name, config, workload)


if __name__ == "__main__":
    main(sys.argv[1:])
