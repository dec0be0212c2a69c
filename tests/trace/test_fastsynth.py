"""The full model's event stream built from a shortened copy's (llmem_plugin.trace.fastsynth)
equals the stream traced from the full model, event for event."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.trace import fastsynth
from llmem_plugin.models import modelbuild
from llmem_plugin.estimate import _trace
from llmem_plugin.models.layerkinds import layer_kinds, plan_layers, shortened_config
from llmem_plugin.models.config import decoder_layers
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config


def traces(cfg, wl, *, tag_layers=True):
    kinds, _ = layer_kinds(cfg)
    plan = plan_layers(kinds)
    short, long = (
        _trace(modelbuild.build_model(shortened_config(cfg, plan.indices(n), kinds), wl), wl, tag_layers=tag_layers)
        for n in (plan.traced, plan.traced + 1)
    )
    full = _trace(modelbuild.build_model(cfg, wl), wl, tag_layers=tag_layers)
    return plan, short, long, full


CASES = {
    "llama": ("llama", Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")),
    "gpt2-autocast-cache": ("gpt2", Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed")),
    "llama-lora-bf16": ("llama", Workload(seq_len=32, micro_batch_size=1, precision="bf16", lora=LoraSpec(rank=4))),
    "llama-checkpointing": ("llama", Workload(seq_len=32, micro_batch_size=1, grad_checkpointing=True)),
    "llama-foreach-off": ("llama", Workload(seq_len=32, micro_batch_size=1, optimizer="adamw-forloop")),
    "llama-fused-accum": ("llama", Workload(seq_len=32, micro_batch_size=1, optimizer="adamw-fused",
                                            grad_accum_steps=2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_built_stream_is_the_traced_stream(name):
    arch, wl = CASES[name]
    cfg = tiny_config(arch, **{"n_layer" if arch == "gpt2" else "num_hidden_layers": 8})
    plan, short, long, full = traces(cfg, wl)
    assert plan.repeats - plan.traced >= 3  # at least three units are added
    built = fastsynth.full_depth_trace(short, long, plan, dataclasses.replace(full, events=[], timeline=[]))
    # Equal canonical forms (sign, bytes, which allocation a free releases) replay identically.
    assert fastsynth._canonical(built.events) == fastsynth._canonical(full.events)
    assert [p for _, p, _ in built.timeline] == [p for _, p, _ in full.timeline]
    assert built.marks == full.marks


def test_tagging_changes_nothing_the_tracker_records():
    cfg = tiny_config("llama", num_hidden_layers=4)
    wl = Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", optimizer="adamw-fused")
    tagged = _trace(modelbuild.build_model(cfg, wl), wl, tag_layers=True)
    plain = _trace(modelbuild.build_model(cfg, wl), wl)
    assert tagged.events == plain.events and tagged.marks == plain.marks
    assert plain.layer_tags is None and len(tagged.layer_tags.event_layer) == len(tagged.events)
    # Each of the 4 layers' parameters is registered in its own layer.
    assert set(tagged.layer_tags.record_layer) == {None, 0, 1, 2, 3}


def test_decoder_layers_is_the_module_list_of_the_layer_count():
    wl = Workload(seq_len=8)
    assert decoder_layers(modelbuild.build_model(tiny_config("llama"), wl)) == "model.layers"
    assert decoder_layers(modelbuild.build_model(tiny_config("gpt2"), wl)) == "transformer.h"
    lora = Workload(seq_len=8, lora=LoraSpec(rank=4))
    assert decoder_layers(modelbuild.build_model(tiny_config("llama"), lora)) == "base_model.model.model.layers"


def test_guard_refuses_a_copy_that_does_not_repeat():
    cfg = tiny_config("llama", num_hidden_layers=8)
    wl = Workload(seq_len=32, micro_batch_size=1)
    plan, short, long, full = traces(cfg, wl)
    # One more allocation in the shorter copy's optimizer: the longer copy
    # with a period taken out no longer matches it.
    tags = short.layer_tags
    extra = len(tags.record_layer)  # a new record, outside the layers
    odd = dataclasses.replace(
        short,
        events=[*short.events[:-1], (1, extra, 512), short.events[-1]],
        timeline=[*short.timeline, short.timeline[-1]],
        layer_tags=dataclasses.replace(tags, event_layer=[*tags.event_layer[:-1], None, tags.event_layer[-1]],
                                       record_layer=[*tags.record_layer, None],
                                       record_role=[*tags.record_role, ("", "optimizer", 512)],
                                       record_requested=[*tags.record_requested, 512]),
    )
    with pytest.raises(fastsynth.SynthesisError, match=f"at event {len(short.events) - 1} of {len(short.events) + 1}"):
        fastsynth.full_depth_trace(odd, long, plan, full)
    untagged = dataclasses.replace(short, layer_tags=None)
    with pytest.raises(fastsynth.SynthesisError, match="no decoder layer list"):
        fastsynth.full_depth_trace(untagged, long, plan, full)
