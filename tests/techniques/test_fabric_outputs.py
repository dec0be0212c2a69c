"""Lightning Fabric's output cast (``Workload.outputs_to_fp32``): the
wrapper returns every floating output of the model as an fp32 copy
(``_FabricModule.forward`` -> ``precision.convert_output``, Lightning 2.4),
and a loop that computes its loss on the returned logits (litgpt) runs it on
those copies. Checked against real CPU runs and the closed form of what the
plain loop then holds between micro-steps."""

from __future__ import annotations

import pytest

from llmem_plugin.errors import ConfigError
from llmem_plugin.trace.step import micro_mark
from llmem_plugin.trace.tracker import round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real
from tests.trace.test_plain_loop import _live_at

_LOSSES = {
    "hf": {},
    "no-upcast": {},
    "chunked": {"loss_chunks": 4, "loss_chunk_upcast": False},
}


@pytest.mark.parametrize("loss", sorted(_LOSSES))
def test_fabric_output_cast_fake_trace_equals_a_real_cpu_run(loss):
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", grad_accum_steps=2, runner="plain-loop",
                  lora=LoraSpec(rank=4, adapter_dtype="base"), loss=loss, outputs_to_fp32=True, **_LOSSES[loss])
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


@pytest.mark.parametrize(("loss", "chunks"), [("hf", 1), ("no-upcast", 1), ("chunked", 4)])
def test_the_loop_keeps_the_fp32_copies_of_a_bf16_models_logits(loss, chunks):
    """Between micro-steps a plain loop under Fabric holds the converted
    output: 4 bytes per logit, where the bf16 model returned 2, whichever
    loss ran (the model's own before the cast, or the loop's on the copies),
    and the fp32 loss."""
    cfg = tiny_config("llama")
    b, s = 2, 64
    held = {}
    for cast in (False, True):
        traces = {}
        for runner in ("torch", "plain-loop"):
            wl = Workload(seq_len=s, micro_batch_size=b, precision="bf16", runner=runner, loss=loss,
                          outputs_to_fp32=cast, **_LOSSES[loss])
            traces[runner], _ = fake_and_real(cfg, wl)
        mark = micro_mark(1, 0)
        held[cast] = _live_at(traces["plain-loop"], mark) - _live_at(traces["torch"], mark)
    per_chunk = b * (s // chunks) * cfg.vocab_size
    assert held[True] == chunks * round_allocation(4 * per_chunk) + round_allocation(4)
    # Without the cast: the model's bf16 logits (the hf loss returns them as the model made them).
    assert held[False] == chunks * round_allocation(2 * per_chunk) + round_allocation(4 if loss == "hf" else 2)


@pytest.mark.parametrize("runner", ["hf-trainer", "lightning"])
def test_the_cast_is_refused_where_the_runner_casts_as_its_own_code_does(runner):
    with pytest.raises(ConfigError, match="--outputs-to-fp32 .* --runner"):
        Workload(runner=runner, outputs_to_fp32=True)
