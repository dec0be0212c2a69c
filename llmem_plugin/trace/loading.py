"""The setup phase: weights arriving on the GPU before the first step.

The step's trace starts from the weights in place. How they got there can
hold more memory than the step, and what the caching allocator keeps from it
stays reserved during training. :func:`place_weights` records the loading as
the job does it, on the same tracker, before the first micro-batch
(``Workload.load``):

* ``direct`` (default, not quantized): each tensor lands once in its
  training dtype, as ``from_pretrained(..., dtype=..., device_map="cuda")``
  or ``.to("cuda")`` of a model already in that dtype does. Nothing beyond
  the weights.
* ``fp32-cast``: the model is first materialised on the GPU in fp32 and then
  cast to its 16-bit training dtype with ``Module.to(dtype)``, which converts
  one parameter at a time (``nn.Module._apply``: the new tensor is made, then
  the old one released): all fp32 weights plus one 16-bit parameter at the peak.
* QLoRA (``quantize`` set) loads as transformers' bitsandbytes integration
  does (``Params4bit.to(device)`` -> ``_quantize``, bitsandbytes 0.50.2
  ``nn/modules.py``, ``functional.py quantize_4bit``): each quantized
  weight arrives in its 16-bit checkpoint dtype, is quantized (the packed
  weight, fp32 absmax; with double quantization the fp32 absmax minus its
  mean is quantized blockwise and both fp32 copies released), then released.
  With ``kbit_prepare="on"``, peft's ``prepare_model_for_kbit_training``
  then casts every other 16-bit parameter to fp32, one at a time.
  ``device-quantize``: the whole model is first materialised on the GPU in
  its 16-bit dtype (every weight, in parameter order), then each linear layer
  is quantized in module order and its 16-bit weight released (a 16-bit model
  moved to the GPU before bitsandbytes' ``Params4bit.to`` quantizes it, as
  benchmarks/groundtruth/techniques.py ``_build_quantized`` does): the 4-bit
  weights are carved out of the 16-bit weights' freed blocks, so segments
  that empty_cache cannot release keep holes between them.
* torchao's NF4 (``--quantize nf4-torchao``) loads as torchtune does
  (:mod:`llmem_plugin.techniques.nf4_setup`): the model made on the device,
  each weight quantized from a 16-bit one with ``to_nf4``, then the
  checkpoint loaded into it, every NF4 weight quantized again
  (``--load direct``: torchtune 0.6.1 with torchao 0.18.0; ``--load
  torchtune-0.1``: torchtune 0.1, whose builder deep-copies one quantized
  layer per layer, with torchao 0.1's unchunked conversion).
* LoRA adapters are made last (peft's ``get_peft_model``), in their dtype.

Checks: tests/trace/test_loading.py (closed forms of each path's peak; the
stub CUDA device for ``Module.to``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["LOADED_MARK", "direct_only", "direct_only_active", "has_transients", "load_trace", "place_weights",
           "splice"]

# The trace mark at the end of the setup phase, once every weight is in place
# (its key in TraceResult.marks is "loaded:setup"): where a step's trace and a
# separately traced setup phase join (:func:`splice`).
LOADED_MARK = "loaded"
_HALF = (torch.float16, torch.bfloat16)


_direct_only = [False]


@contextlib.contextmanager
def direct_only() -> Iterator[None]:
    """Within this block :func:`place_weights` only registers the weights (fast
    mode traces the shortened copies so; :func:`splice` adds the setup after)."""
    _direct_only.append(True)
    try:
        yield
    finally:
        _direct_only.pop()


def direct_only_active() -> bool:
    """Whether :func:`direct_only` is in force (it changes what a trace records)."""
    return _direct_only[-1]


def has_transients(workload) -> bool:
    """Whether loading allocates more than the weights themselves."""
    # torchao's NF4 (torchtune) quantizes every weight on the device while building and loading
    # (llmem_plugin.techniques.nf4_setup); bitsandbytes on load.
    return workload.load != "direct" or workload.quantize is not None


def _adapters(model: nn.Module, workload) -> set[int]:
    if workload.lora is None:
        return set()
    return {id(p) for n, p in model.named_parameters() if "lora_" in n}


def _quantized_layers(model: nn.Module) -> list[nn.Module]:
    from llmem_plugin.techniques.quant import Linear4bitStandIn

    return [m for m in model.modules() if isinstance(m, Linear4bitStandIn)]


def place_weights(tracker, model: nn.Module, params: list[torch.Tensor], workload, register) -> None:
    """Record the setup phase's allocations; every parameter is registered by the end.

    Args:
        tracker: The step's tracker (inside its fake mode when tracing).
        model: The model (unwrapped).
        params: The parameters to register, in order.
        workload: Its ``load``, ``quantize``, ``kbit_prepare`` and ``lora``.
        register: Registers a list of parameters (the engine's
            ``register_parameters`` with the tracker bound).
    """
    from llmem_plugin.workload import Quantization

    quantized = _quantized_layers(model) if workload.quantize is not None else []
    torchao = workload.quantize is Quantization.NF4_TORCHAO
    if _direct_only[-1] or (workload.load == "direct" and not quantized and not torchao):
        register(params)
        return
    done: set[int] = set()
    adapters = _adapters(model, workload)

    def put(ts: list[torch.Tensor]) -> None:
        new = [t for t in ts if id(t) not in done]
        if new:
            register(new)
            done.update(id(t) for t in new)

    if torchao:  # torchtune builds the model on the device, then loads the checkpoint into it
        from llmem_plugin.techniques.nf4_setup import place_nf4_weights

        place_nf4_weights(tracker, model, params, workload, put, adapters)
        return

    if workload.load == "fp32-cast":
        base = [p for p in params if id(p) not in adapters]
        staged = []
        for p in base:
            with tracker.owned_by(p):
                staged.append(torch.empty(p.shape, dtype=torch.float32) if p.dtype in _HALF else None)
        put([p for p, t in zip(base, staged) if t is None])
        for i, p in enumerate(base):
            if staged[i] is not None:
                put([p])  # _apply: the cast tensor, then the fp32 one released
                staged[i] = None
        put(params)  # the adapters, made after the cast
        return
    # QLoRA through transformers' bitsandbytes integration, layer by layer in module order.
    owner = {id(m.weight): m for m in quantized}
    bias_of = {id(m.bias) for m in quantized if m.bias is not None}
    load_dtype = quantized[0].quant_dtype
    upcast = [p for p in params if id(p) not in adapters and id(p) not in owner and id(p) not in bias_of
              and p.dtype == torch.float32 and workload.kbit_prepare != "off" and load_dtype in _HALF]
    loaded_as: dict[int, torch.Tensor] = {}
    on_device = workload.load == "device-quantize"
    for p in params:
        if id(p) in adapters:
            continue
        layer = owner.get(id(p))
        if layer is None:
            if any(p is q for q in upcast):  # loaded 16-bit, cast to fp32 by k-bit preparation below
                with tracker.owned_by(p):
                    loaded_as[id(p)] = torch.empty(p.shape, dtype=load_dtype)
            else:
                put([p])
            continue
        if on_device:  # the 16-bit weight, made with the model; quantized once all are in place
            with tracker.owned_by(layer.weight):
                loaded_as[id(p)] = torch.empty((layer.out_features, layer.in_features), dtype=load_dtype)
        else:
            _quantize_on_load(layer, load_dtype, put, tracker)
    if on_device:
        for layer in quantized:  # in module order, each 16-bit weight released after its quantization
            _quantize_on_load(layer, load_dtype, put, tracker, loaded_as.pop(id(layer.weight)))
    for p in upcast:  # prepare_model_for_kbit_training: param.data = param.data.to(torch.float32)
        put([p])
        del loaded_as[id(p)]
    put(params)


def _quantize_on_load(layer, load_dtype: torch.dtype, put, tracker, w: torch.Tensor | None = None) -> None:
    """``Params4bit._quantize``: the 16-bit weight on the device (``w``, or made here), ``quantize_4bit``,
    the weight released."""
    from llmem_plugin.trace.tracker import MemoryCategory

    if w is None:
        with tracker.owned_by(layer.weight):
            w = torch.empty((layer.out_features, layer.in_features), dtype=load_dtype)
    put([layer.weight])  # the packed 4-bit weight
    buffers = dict(layer.named_buffers())
    if not layer.double_quant:
        tracker.register([buffers["absmax"]], MemoryCategory.PARAMETER)
    else:
        blocks = math.ceil(layer.out_features * layer.in_features / layer.blocksize)
        with tracker.owned_by(layer.weight):
            absmax32 = torch.empty((blocks,), dtype=torch.float32)  # quantize_4bit's fp32 absmax
        tracker.register([buffers["absmax_offset"]], MemoryCategory.PARAMETER)  # _absmax.mean()
        with tracker.owned_by(layer.weight):
            centred = torch.empty((blocks,), dtype=torch.float32)  # _absmax - offset
        rest = [b for n, b in buffers.items() if n not in ("absmax_offset",)]
        tracker.register(rest, MemoryCategory.PARAMETER)  # quantize_blockwise: uint8 absmax, nested absmax, code
        del centred, absmax32
    tracker.register(list(buffers.values()), MemoryCategory.PARAMETER)
    if layer.bias is not None:
        put([layer.bias])
    del w


def load_trace(model: nn.Module, workload):
    """The setup phase alone, traced on ``model`` (a meta model, made fake here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    modelbuild.fakeify(model, mode)
    tracker = MemoryTracker()
    with mode, tracker:
        params = list(model.parameters())
        place_weights(tracker, model, params, workload, lambda ps: tracker.register(ps, MemoryCategory.PARAMETER))
        tracker.register(list(model.buffers()), MemoryCategory.PARAMETER)
        tracker.mark(LOADED_MARK)
    return tracker.result()


def splice(setup, step):
    """``step``'s trace with its setup phase (the weights registered) replaced by ``setup``'s.

    Nothing after the setup frees a weight, so the two streams join at the
    ``loaded`` mark; the setup's records are renumbered past the step's.
    """
    from llmem_plugin.trace.tracker import Phase

    key = f"{LOADED_MARK}:{Phase.SETUP.value}"
    cut, head = step.marks.get(key), setup.marks.get(key)
    if cut is None or head is None:
        raise ValueError("both traces need the loaded mark")  # internal: traces made by trace_step/load_trace
    offset = 1 + max((e[1] for e in step.events), default=0)
    events = [(sign, rec + offset, n) for sign, rec, n in setup.events[:head]] + step.events[cut:]
    base = setup.timeline[head - 1][2] if head else 0
    shift = base - (step.timeline[cut - 1][2] if cut else 0)
    timeline = [(i, ph, v) for i, ph, v in setup.timeline[:head]]
    timeline += [(i + head - cut, ph, v + shift) for i, ph, v in step.timeline[cut:]]
    marks = {n: (p - cut + head if p >= cut else p) for n, p in step.marks.items()}
    marks[key] = head
    setup_peak = max((v for _, _, v in setup.timeline[:head]), default=0)
    phase_peaks = dict(step.phase_peaks)
    phase_peaks[Phase.SETUP] = max(phase_peaks.get(Phase.SETUP, 0), setup_peak)
    peak = max(step.peak_bytes + shift, setup_peak)
    changes = {"events": events, "timeline": timeline, "marks": marks, "num_events": len(events),
               "phase_peaks": phase_peaks, "records": None}
    if step.records is not None and setup.records is not None:  # keys below offset are the step's, the rest the setup's
        keep = list(range(min(offset, len(step.records))))
        fill = [0] * (offset - len(keep))  # keys no event uses
        changes["records"] = step.records.take(keep + fill).joined(setup.records)
    if setup_peak > step.peak_bytes + shift:
        changes.update(peak_bytes=peak, peak_phase=Phase.SETUP, peak_module="", breakdown=dict(setup.breakdown))
    else:
        changes["peak_bytes"] = peak
    return dataclasses.replace(step, **changes)
