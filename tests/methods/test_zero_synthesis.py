"""ZeRO-3's full-depth event stream built from two shortened runs (methods.synthesized).

The independent source is the full trace of the same configuration: where
DeepSpeed's rules carry no state past a layer (zero.synthesis_blocker), the
built stream must give its figures to the byte; where they do, the method
must trace in full and say why.
"""

from __future__ import annotations

import pytest

from llmem_plugin.trace.fastsynth import SynthesisError, full_depth_trace
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import _shortened, estimate_method, zero
from llmem_plugin.methods.base import capture
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import round_allocation
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
LAYOUT = Layout(num_gpus=4)
MODEL = tiny_config("llama", num_hidden_layers=10)
# One layer holds 43,136 parameters (q, o 64x64; k, v 64x32; gate, up, down 64x160; two norms of 64): every
# window below stays inside a layer, and only the norms are persistent.
WINDOWS = {"zero_optimization": {"reduce_bucket_size": 20_000, "stage3_prefetch_bucket_size": 20_000,
                                 "stage3_max_live_parameters": 20_000, "stage3_max_reuse_distance": 20_000,
                                 "stage3_param_persistence_threshold": 1_000}}


def _figures(est):
    w = est.worst
    return (w.peak_tensor_bytes, w.peak_allocated_bytes, w.peak_reserved_bytes, w.device_total_bytes,
            w.phase_allocated, w.phase_reserved, w.host_bytes, w.host_overheads,
            est.comm_intra_node_bytes, est.comm_inter_node_bytes)


def _breakdowns_agree(a: dict, b: dict) -> bool:
    # The breakdown at the peak is affine per layer in the allocator's rounded blocks: a flat buffer over
    # all parameters drifts by at most its rounding (512 B) per layer extrapolated (7 here: 3 traced of 10),
    # for each of a category's buffers (two at most: Adam's two states).
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 2 * 7 * 512 for k in a)


@pytest.mark.parametrize("method", ["zero3", "zero3-offload"])
@pytest.mark.parametrize("gc", [False, True])
def test_built_stream_gives_the_full_traces_figures(method, gc):
    wl = Workload(seq_len=64, micro_batch_size=2, grad_accum_steps=2, grad_checkpointing=gc)
    built = estimate_method(method, MODEL, wl, layout=LAYOUT, gpu=H100, config=WINDOWS, stream_synthesis=True)
    full = estimate_method(method, MODEL, wl, layout=LAYOUT, gpu=H100, config=WINDOWS)
    assert any("event stream was built from 3- and 4-layer traces to 10 layers" in n for n in built.notes)
    assert _figures(built) == _figures(full)
    assert _breakdowns_agree(built.worst.breakdown, full.worst.breakdown)


def test_a_window_wider_than_a_layer_traces_in_full():
    # DeepSpeed's default reduce bucket (5e8 elements) spans every layer of this model: the copies would
    # never empty it mid-backward, the full model would.
    wl = Workload(seq_len=64, micro_batch_size=1)
    est = estimate_method("zero3", MODEL, wl, layout=LAYOUT, gpu=H100, stream_synthesis=True)
    note = next(n for n in est.notes if n.startswith("traced in full"))
    assert "reduce_bucket_size=500000000 spans more than a layer's 43136 trainable parameters" in note
    assert _figures(est) == _figures(estimate_method("zero3", MODEL, wl, layout=LAYOUT, gpu=H100))


def test_zero2_and_sub_groups_that_change_with_depth_are_refused():
    wl = Workload(seq_len=64)
    assert "pads each flattened group" in zero.synthesis_blocker(MODEL, wl, layout=LAYOUT, stage=2)
    # Partitions of 43,136 / 4 elements per layer: a sub-group of 20,000 elements closes every ~1.9 layers,
    # so the number of sub-groups grows with depth (with optimizer offload they live on the host).
    cfg = {"zero_optimization": {**WINDOWS["zero_optimization"], "sub_group_size": 20_000}}
    why = zero.synthesis_blocker(MODEL, wl, layout=LAYOUT, stage=3, config=cfg)
    assert why is not None and "sub-groups" in why
    assert zero.synthesis_blocker(MODEL, wl, layout=LAYOUT, stage=3, offload_optimizer=True, config=cfg) is None


def test_a_growing_buffer_outside_the_layers_fails_the_guard_unless_vouched():
    # ZeRO-3's flat partition over all parameters grows with depth: only a method that vouches for it
    # (the full model has the same buffers, affine in depth) may have it grown.
    wl = Workload(seq_len=64)
    plan, c1, c2, _ = _shortened(MODEL, 3)
    traces = []
    for c in (c1, c2):
        with capture() as cap:
            estimate_method("zero3", c, wl, layout=LAYOUT, gpu=H100, config=WINDOWS)
        traces.append(cap.ranks[0][0])
    with pytest.raises(SynthesisError, match="grows with depth"):
        full_depth_trace(*traces, plan, None)
    grown = full_depth_trace(*traces, plan, None, growing_buffers=True)
    # The full model's flat 16-bit partition: ceil(numel / 4) per trainable parameter, in bf16.
    from llmem_plugin.models import modelbuild

    meta = modelbuild.build_model(MODEL, wl, device="meta")
    flat = 2 * sum(-(-p.numel() // 4) for p in meta.parameters() if p.requires_grad)
    assert round_allocation(flat) in {b for s, _, b in grown.events if s > 0}
    assert round_allocation(flat) not in {b for s, _, b in traces[1].events if s > 0}
    assert grown.peak_bytes > traces[1].peak_bytes
