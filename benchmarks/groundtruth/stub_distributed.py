"""Distributed methods on the stub CUDA device, rank by rank, against the estimator.

From the repository root (the stub environment built by ``stubcuda/setup.sh``)::

    python -m benchmarks.groundtruth.stub_distributed --out benchmarks/groundtruth/data/stub-distributed-h100-DATE.jsonl
    python -m benchmarks.groundtruth.stub_distributed --out rows.jsonl --only ddp-w2-tiny fsdp-w2-tiny
    python -m benchmarks.groundtruth.stub_distributed --list

Each config runs every listed rank as its own process on the stub device
(:mod:`.stub_worker`: torch's CUDA build, its real caching allocator, the
real DDP / FSDP2 / DTensor TP / ColossalAI plugin code, and torch's fake
process group, so one process is one rank). The estimator predicts the same
config in this process (``llmem_plugin.methods.estimate_method`` with the
matching preset and layout) and the row holds both, per rank.

The row has the ground-truth fields of :mod:`.rows` where they apply (``id``,
``model``, ``config_overrides``, ``workload``, ``status``, ``error``,
``steps``, ``measured``, ``gpu``, ``env``, ``seconds``) plus ``method``
(the estimator's preset), ``world_size``, ``tp``, ``rank``, ``options``, ``commit`` (of
the checkout that predicted),
``device_kind: "stub"``, ``predicted`` and ``difference`` (predicted minus
stub: positive = over-estimate), ``under_dispatch_mode`` (where they differ:
the stub rerun with backward under a do-nothing ``TorchDispatchMode``, as the
estimator traces it, and the prediction's difference from that), ``segments`` (the stub's reserved bytes per
allocator stream and pool at the end) and ``stub_adjustments`` (what the
worker does differently from a GPU run, :data:`.stub_worker.STUB_ADJUSTMENTS`).
``measured.device_total_bytes`` is null: the stub's device-used memory is
not a GPU's ("not measured").

What the fake process group does not do that NCCL does: its collectives
allocate nothing of their own (no NCCL buffers, which lie outside PyTorch's
allocator anyway; the estimator adds them to ``device_total_bytes`` only) and
complete at once, so no tensor outlives a collective waiting on the network.
Allocations made on a wrapper's side streams do land in their own
caching-allocator pools, as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "StubConfig", "main", "predict", "run_config"]

_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GPU = "h100-sxm"

# tests/conftest.py TINY_CONFIGS' Llama on the llama-3.2-1b catalog config
# (as matrix._TINY): 2 layers, hidden 64, 4/2 heads, vocab 512, tied embeddings.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "head_dim": 16}
TINY_WORKLOAD = {"seq_len": 64, "micro_batch_size": 2, "precision": "bf16-mixed"}
# Llama-3.2-1B's own shapes (hidden 2048, vocab 128256), 4 layers, untied so
# that the embedding and the head are separate 1 GiB fp32 parameters.
MID = {"num_hidden_layers": 4, "tie_word_embeddings": False}
MID_WORKLOAD = {"seq_len": 512, "micro_batch_size": 2, "precision": "bf16-mixed"}


@dataclass(frozen=True, kw_only=True)
class StubConfig:
    """One distributed config.

    Attributes:
        id: Stable name, the rows' ``id`` prefix.
        method: Estimator preset (``llmem_plugin.methods.method_names()``).
        worker: :mod:`.stub_worker` method (``single``, ``ddp``, ``fsdp``,
            ``tp``, ``lowlevel``, ``gemini``, ``hybrid``).
        world: World size.
        tp: Tensor-parallel degree.
        ranks: Ranks run on the stub.
        options: Method options, passed to both sides (e.g. FSDP2's
            ``reshard_after_forward``, LowLevelZero's ``stage``).
        estimator_options: Options for the estimator only.
        model: Catalog name; ``overrides`` applied (``matrix.case_config``).
        workload: ``llmem_plugin.Workload`` fields.
    """

    id: str
    method: str
    worker: str
    world: int
    ranks: tuple[int, ...]
    tp: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    estimator_options: dict[str, Any] = field(default_factory=dict)
    model: str = "llama-3.2-1b"
    overrides: dict[str, Any] = field(default_factory=lambda: dict(TINY))
    workload: dict[str, Any] = field(default_factory=lambda: dict(TINY_WORKLOAD))

    def spec(self, rank: int) -> dict[str, Any]:
        return {"method": self.worker, "options": self.options, "world": self.world, "tp": self.tp, "rank": rank,
                "model": self.model, "overrides": self.overrides, "workload": self.workload}


def _mid(**kw: Any) -> StubConfig:
    return StubConfig(overrides=dict(MID), workload=dict(MID_WORKLOAD), **kw)


CONFIGS: list[StubConfig] = [
    # One GPU, no wrapper: the single-device baseline of each model (what is
    # left of a difference here is no distributed method's).
    StubConfig(id="single-tiny", method="single", worker="single", world=1, ranks=(0,)),
    _mid(id="single-mid", method="single", worker="single", world=1, ranks=(0,)),
    StubConfig(id="ddp-w2-tiny", method="ddp", worker="ddp", world=2, ranks=(0, 1)),
    _mid(id="ddp-w2-mid", method="ddp", worker="ddp", world=2, ranks=(0, 1)),
    _mid(id="ddp-w8-mid", method="ddp", worker="ddp", world=8, ranks=(0, 7)),
    StubConfig(id="fsdp-w2-tiny", method="fsdp", worker="fsdp", world=2, ranks=(0, 1)),
    _mid(id="fsdp-w2-mid", method="fsdp", worker="fsdp", world=2, ranks=(0, 1)),
    _mid(id="fsdp-w8-mid", method="fsdp", worker="fsdp", world=8, ranks=(0, 7)),
    # ZeRO-2-like: parameters stay gathered from forward to backward, the
    # gradients and optimizer states sharded.
    StubConfig(id="fsdp-noreshard-w2-tiny", method="fsdp", worker="fsdp", world=2, ranks=(0, 1),
               options={"reshard_after_forward": False}),
    _mid(id="fsdp-noreshard-w2-mid", method="fsdp", worker="fsdp", world=2, ranks=(0, 1),
         options={"reshard_after_forward": False}),
    StubConfig(id="tp2-tiny", method="tp", worker="tp", world=2, tp=2, ranks=(0, 1)),
    _mid(id="tp2-mid", method="tp", worker="tp", world=2, tp=2, ranks=(0, 1)),
    # TP inside, FSDP2 fully_shard / replicate over the data-parallel dimension.
    StubConfig(id="fsdp-tp2-w4-tiny", method="fsdp-tp", worker="tp", world=4, tp=2, ranks=(0, 3),
               options={"data_parallel": "fully_shard"}),
    StubConfig(id="dp-tp2-w4-tiny", method="dp-tp", worker="tp", world=4, tp=2, ranks=(0, 3),
               options={"data_parallel": "replicate"}),
    _mid(id="fsdp-tp2-w4-mid", method="fsdp-tp", worker="tp", world=4, tp=2, ranks=(0, 3),
         options={"data_parallel": "fully_shard"}),
    StubConfig(id="lowlevel-zero1-w2-tiny", method="lowlevel-zero1", worker="lowlevel", world=2, ranks=(0, 1),
               options={"stage": 1}),
    StubConfig(id="lowlevel-zero2-w2-tiny", method="lowlevel-zero2", worker="lowlevel", world=2, ranks=(0, 1),
               options={"stage": 2}),
    _mid(id="lowlevel-zero1-w2-mid", method="lowlevel-zero1", worker="lowlevel", world=2, ranks=(0, 1),
         options={"stage": 1}),
    _mid(id="lowlevel-zero2-w2-mid", method="lowlevel-zero2", worker="lowlevel", world=2, ranks=(0, 1),
         options={"stage": 2}),
    StubConfig(id="gemini-w2-tiny", method="gemini", worker="gemini", world=2, ranks=(0,)),
    StubConfig(id="hybrid-tp2-tiny", method="hybrid", worker="hybrid", world=2, tp=2, ranks=(0,)),
]

# Worker options that are the plugin's own constructor arguments, not the
# estimator's (the preset carries them: lowlevel-zero1 is stage 1).
_WORKER_ONLY = {"stage"}


def predict(config: StubConfig, *, gpu: str = DEFAULT_GPU) -> dict[int, dict[str, int]]:
    """The estimator's allocated and reserved peaks per rank it reports.

    Raises:
        llmem_plugin.errors.LLMemError: The estimator refuses the config.
    """
    import torch

    from benchmarks.groundtruth.matrix import case_config
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.workload import Workload

    # The stub's cuDNN computes nothing, so its SDPA backend is off there; the
    # estimator's SDPA emulation reads the same switch (restored afterwards).
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    options = {k: v for k, v in config.options.items() if k not in _WORKER_ONLY}
    try:
        est = estimate_method(config.method, case_config(config.model, config.overrides),
                              Workload(**config.workload), layout=Layout(num_gpus=config.world, tp=config.tp),
                              gpu=gpu, **options, **config.estimator_options)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    return {r.rank: {"allocated_bytes": r.peak_allocated_bytes, "reserved_bytes": r.peak_reserved_bytes}
            for r in est.ranks}


def _commit() -> str | None:
    from benchmarks.groundtruth.provenance import checkout_commit

    return checkout_commit(_REPO_ROOT)


def _predicted_for(pred: dict[int, dict[str, int]], rank: int) -> tuple[dict[str, int], str]:
    if rank in pred:
        return pred[rank], f"rank {rank}"
    # The estimator reports one rank when its rules make the others alike
    # (DDP, TP) or reports rank 0 and the last rank (uneven FSDP shards).
    src = max(r for r in pred if r <= rank)
    return pred[src], f"rank {src} (the estimator reports ranks alike to it)"


def measure(config: StubConfig, rank: int, *, gpu: str = DEFAULT_GPU, timeout_s: float = 600.0,
            noop_mode: bool = False, capacity: int | None = None, extra: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Run one rank on the stub device; the worker's JSON (``error`` set on failure).

    Args:
        capacity: Bytes the stub device hands out (``stubcuda/run --capacity``; default its memory).
        extra: Spec fields beside the config's (``steps``, ``seq_lens``: :mod:`.stub_worker`).
        noop_mode: Run backward under a do-nothing ``TorchDispatchMode``, as
            the estimator's trace runs it (a diagnostic: autograd then sums a
            tensor's incoming gradients out of place, see the note).
    """
    from stubcuda import runner

    spec = {**config.spec(rank), "noop_mode": noop_mode, **(extra or {})}
    proc = runner.run_python(["-m", "benchmarks.groundtruth.stub_worker", json.dumps(spec)],
                             gpu=gpu, capacity=capacity, timeout_s=timeout_s, cwd=_REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": f"worker printed no result: {tail[0][:400]}"}
    return json.loads(lines[-1])


def run_config(config: StubConfig, *, gpu: str = DEFAULT_GPU) -> list[dict[str, Any]]:
    """Rows for every rank of ``config``: stub measurement and prediction."""
    from benchmarks.groundtruth import rows
    from benchmarks.groundtruth.stub_worker import STUB_ADJUSTMENTS

    try:
        pred: dict[int, dict[str, int]] | None = predict(config, gpu=gpu)
        pred_error = None
    except Exception as e:  # noqa: BLE001 - recorded in the row
        pred, pred_error = None, rows.error_text(e)
    out = []
    for rank in config.ranks:
        t0 = time.perf_counter()
        got = measure(config, rank, gpu=gpu)
        row: dict[str, Any] = {
            "id": f"{config.id}-r{rank}",
            "model": config.model,
            "config_overrides": dict(config.overrides),
            "runner": "stub-distributed",
            "device": "stub",
            "device_kind": "stub",
            "method": config.method,
            "world_size": config.world,
            "tp": config.tp,
            "rank": rank,
            "options": dict(config.options),
            "workload": dict(config.workload),
            "status": "error" if "error" in got else "ok",
            "error": got.get("error"),
            "where": got.get("where"),
            "steps": got.get("steps", []),
            "measured": {"allocated_bytes": None, "reserved_bytes": None, "device_total_bytes": None},
            "device_used": "not measured",
            "segments": got.get("segments"),
            "predicted": None,
            "predicted_from": None,
            "prediction_error": pred_error,
            "difference": None,
            "stub_adjustments": {k: STUB_ADJUSTMENTS[k] for k in got.get("adjustments", [])},
            "gpu": got.get("gpu"),
            "env": got.get("env"),
            "commit": _commit(),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        if row["steps"]:
            row["measured"]["allocated_bytes"] = max(s["allocated_bytes"] for s in row["steps"])
            row["measured"]["reserved_bytes"] = max(s["reserved_bytes"] for s in row["steps"])
        if pred is not None:
            row["predicted"], row["predicted_from"] = _predicted_for(pred, rank)
            if row["status"] == "ok":
                row["difference"] = {k: row["predicted"][k] - row["measured"][k]
                                     for k in ("allocated_bytes", "reserved_bytes")}
                if any(row["difference"].values()):
                    row["under_dispatch_mode"] = _under_dispatch_mode(config, rank, row["predicted"], gpu=gpu)
        out.append(row)
    return out


def _under_dispatch_mode(config: StubConfig, rank: int, predicted: dict[str, int], *, gpu: str) -> dict[str, Any]:
    """The same rank with backward under a do-nothing dispatch mode, and the
    prediction's difference from that: what is left once the tracer's own
    effect on autograd is taken out."""
    got = measure(config, rank, gpu=gpu, noop_mode=True)
    if "error" in got:
        return {"error": got["error"]}
    measured = {k: max(s[k] for s in got["steps"]) for k in ("allocated_bytes", "reserved_bytes")}
    return {"measured": measured, "difference": {k: predicted[k] - measured[k] for k in measured}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSONL file to append rows to")
    parser.add_argument("--only", nargs="*", help="config ids to run (default: all)")
    parser.add_argument("--gpu", default=DEFAULT_GPU, help="catalog GPU the stub device reports")
    parser.add_argument("--list", action="store_true", help="list the config ids and exit")
    args = parser.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(c.id)
        return 0
    if not args.out:
        parser.error("--out is required")
    from stubcuda import runner

    why = runner.missing()
    if why:
        print(f"the stub device cannot run here: {why}", file=sys.stderr)
        return 2
    known = {c.id: c for c in CONFIGS}
    unknown = [i for i in args.only or () if i not in known]
    if unknown:
        parser.error(f"unknown config ids {unknown}; valid: {', '.join(known)}")
    from benchmarks.groundtruth.rows import append_row

    status = 0
    for config in [known[i] for i in args.only] if args.only else CONFIGS:
        for row in run_config(config, gpu=args.gpu):
            append_row(args.out, row)
            d = row["difference"] or {}
            print(f"{row['id']}: {row['status']} stub {row['measured']['allocated_bytes']} / "
                  f"{row['measured']['reserved_bytes']}  predicted {row['predicted']}  diff {d}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
