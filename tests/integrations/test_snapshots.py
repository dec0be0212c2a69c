"""The adapters' predicted snapshot of a distributed job (integrations/_common.py ``predicted_snapshot``)."""

from __future__ import annotations

import dataclasses

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.integrations import _common
from llmem_plugin.methods import Layout
from llmem_plugin.models import modelbuild
from llmem_plugin.snapshot.predict import method_snapshots
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config


def _entries(snap) -> list[tuple[str, int, int]]:
    return [(e["action"], e["size"], e["stream"]) for e in snap["device_traces"][0]]


def test_a_ddp_checks_predicted_snapshot_is_the_traced_ranks_for_every_rank():
    """DDP traces one rank for all (its ranks are alike): every rank's predicted snapshot is that rank's
    history from the wrapped model on, as method_snapshots writes it; without keep_trace there is none."""
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")
    model = modelbuild.build_model(tiny_config("llama"), wl, device="cpu")
    gpu = get_gpu("h100-sxm")
    check = _common.check(_common.live_model(model), wl, method="ddp", num_gpus=2, gpu=gpu, keep_trace=True)
    (traced,) = method_snapshots("ddp", model, wl, layout=Layout(num_gpus=2), gpu=gpu, after_load=True).values()
    for rank in (0, 1):
        got = _common.predicted_snapshot(check, rank=rank)
        assert got["llmem"]["method"] == "ddp" and len(got["device_traces"][0]) > 100
        assert _entries(got) == _entries(traced)
    assert list(_common.predicted_snapshots(check)) == [0]  # what Lightning's rank 0 hands every rank
    assert _common.predicted_snapshot(dataclasses.replace(check, method_call=None), rank=1) is None
    plain = _common.check(_common.live_model(model), wl, method="ddp", num_gpus=2, gpu=gpu)
    assert plain.method_call is None and _common.predicted_snapshot(plain) is None


def test_a_rank_takes_its_own_snapshot_or_the_only_one():
    """Where a method traces several distinct ranks, a rank not among them gets none (which one it is
    alike to is not reported); where it traces one for all, every rank gets that one."""
    own, other = {"rank": 0}, {"rank": 3}
    assert _common.snapshot_for_rank({0: own, 3: other}, 3) is other
    assert _common.snapshot_for_rank({0: own, 3: other}, 1) is None
    assert _common.snapshot_for_rank({0: own}, 5) is own
    assert _common.snapshot_for_rank(None, 0) is None and _common.snapshot_for_rank({}, 0) is None
