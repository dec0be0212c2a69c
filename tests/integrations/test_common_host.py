"""The adapters' check stops a job whose host memory does not fit this machine."""

from __future__ import annotations

import transformers

from llmem_plugin.device import host
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.integrations._common import check, live_model
from llmem_plugin.workload import Workload


def _tiny():
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def test_check_refuses_a_host_misfit(monkeypatch):
    live = live_model(_tiny())
    wl = Workload(seq_len=32, micro_batch_size=1)
    roomy = check(live, wl, gpu=get_gpu("h100-sxm"))
    assert roomy.fits and roomy.host_fits
    # The process needs at least its baseline (host.process_baseline_bytes):
    # a machine with 1 GiB of RAM cannot hold it.
    assert host.process_baseline_bytes() > 2**30
    monkeypatch.setattr(host, "local_host_memory", lambda: host.HostCapacity(node_bytes=2**30, source="test"))
    small = check(live, wl, gpu=get_gpu("h100-sxm"))
    assert not small.host_fits and not small.fits
    assert "per GPU at the peak fits h100-sxm" in small.message()  # the GPU side fits
    assert "host memory does not fit" in small.message() and "1.00 GiB on this machine" in small.message()
