"""The hand-written training loop (``runner="plain-loop"``): the last
micro-step's outputs and loss, and so its autograd graph, live until the next
forward returns. Checked against real CPU runs and against the closed form of
what the outputs hold."""

from __future__ import annotations

import pytest

from llmem_plugin.trace.step import micro_mark
from llmem_plugin.trace.tracker import round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real


def _live_at(trace, mark: str) -> int:
    end = trace.marks[mark]
    return sum(sign * nbytes for sign, _, nbytes in trace.events[:end])


@pytest.mark.parametrize("loss", ["hf", "chunked"])
def test_plain_loop_fake_trace_equals_a_real_cpu_run(loss):
    extra = {"loss_chunks": 4, "loss_chunk_upcast": False} if loss == "chunked" else {}
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", grad_accum_steps=2, runner="plain-loop",
                  lora=LoraSpec(rank=4), loss=loss, **extra)
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


@pytest.mark.parametrize(("loss", "chunks"), [("hf", 1), ("chunked", 4)])
def test_the_last_steps_logits_and_loss_are_alive_when_the_next_step_starts(loss, chunks):
    """Between micro-steps the plain loop holds exactly the model output: its
    fp32 logits (one tensor, or one per chunk of a chunked head that returns
    them, as litgpt's ``lm_head_chunk_size`` does) and the 0-dim loss; every
    saved tensor of its graph was released by backward."""
    cfg = tiny_config("llama")
    b, s = 2, 64
    extra = {"loss_chunks": chunks, "loss_chunk_upcast": False} if loss == "chunked" else {}
    traces = {}
    for runner in ("torch", "plain-loop"):
        wl = Workload(seq_len=s, micro_batch_size=b, precision="fp32", runner=runner, loss=loss, **extra)
        traces[runner], _ = fake_and_real(cfg, wl)
    mark = micro_mark(1, 0)  # the second iteration's first micro-step, before its inputs
    held = _live_at(traces["plain-loop"], mark) - _live_at(traces["torch"], mark)
    logits = chunks * round_allocation(4 * b * (s // chunks) * cfg.vocab_size)
    assert held == logits + round_allocation(4)


def test_old_bitsandbytes_inputs_outlive_the_step_in_a_plain_loop():
    """bitsandbytes 0.42.0 keeps each 4-bit matmul's input in its graph
    (``ctx.tensors``): with the plain loop they are alive between steps, and
    the fake trace still equals a real CPU run."""
    cfg = tiny_config("llama")
    base = dict(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4", kbit_prepare="off",
                lora=LoraSpec(rank=4), runner="plain-loop")
    old = Workload(bnb_version="0.42.0", **base)
    fake, real = fake_and_real(cfg, old)
    assert fake.peak_bytes == real.peak_bytes
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]
    new, _ = fake_and_real(cfg, Workload(bnb_version="0.50.2", **base))
    mark = micro_mark(1, 0)
    # Per layer the distinct 4-bit matmul inputs: the attention norm's output (q, k, v share it), the
    # attention output into o_proj, the MLP norm's output (gate, up) and the SwiGLU product into down_proj.
    # The first layer's attention input needs no gradient (the frozen embeddings feed it), so no graph
    # node keeps it (``needs_input_grad`` all False).
    tokens, h, i = 2 * 64, cfg.hidden_size, cfg.intermediate_size
    per_layer = 3 * round_allocation(2 * tokens * h) + round_allocation(2 * tokens * i)
    expected = cfg.num_hidden_layers * per_layer - round_allocation(2 * tokens * h)
    assert _live_at(fake, mark) - _live_at(new, mark) == expected
