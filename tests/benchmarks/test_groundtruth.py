"""The ground-truth harness (benchmarks/groundtruth): matrix invariants, the CPU path, the CLI.

The CUDA path cannot run here; its two training loops are run on the CPU
with a stub recorder, and its worker process is run far enough to check that a
crash or a time-out still yields a well-formed "error" row.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.groundtruth import cuda, rows, run
from benchmarks.groundtruth.matrix import CPU_CASES, GPU_CASES, Case, find
from llmem_plugin.models import catalog
from llmem_plugin.models import modelbuild
from llmem_plugin.trace.step import trace_step
from llmem_plugin.workload import LoraSpec, Workload

CPU_IDS = [
    "tiny-llama-3.2-1b-bf16-s64-b2-gc-sdpa-adamw-fused",
    "tiny-qwen2.5-0.5b-fp32-s64-b2-lora-sdpa",
    "tiny-gemma-2-2b-bf16-mixed-s64-b1-eager",
    # The other tasks: labels [batch] (classifier), a 16-token target (seq2seq).
    "tiny-distilbert-sst2-bf16-mixed-s64-b2-sdpa",
    "tiny-t5-base-bf16-mixed-s64-b2-sdpa-t16",
    "tiny-bart-base-fp32-s32-b2-lora-sdpa-t16",
    "tiny-llama-3.2-11b-vision-bf16-s32-b1-sdpa-img2-frozen-vision",  # images: pixel values at 4 tiles each
    "tiny-seqcls-llama-3.2-1b-bf16-mixed-s64-b2-sdpa",
    "tiny-seqcls-roberta-base-fp32-s64-b2-sdpa",
    "tiny-bert-base-uncased-bf16-mixed-s64-b2-sdpa",
]


def check_schema(row: dict) -> None:
    assert tuple(row) == rows.ROW_KEYS
    assert row["status"] in rows.STATUSES
    assert set(row["measured"]) == set(rows.MEASURED_KEYS)
    assert set(row["env"]) == set(rows.ENV_KEYS)
    assert row["gpu"] is None or set(row["gpu"]) == set(rows.GPU_KEYS)
    for s in row["steps"]:
        assert set(s) == set(rows.STEP_KEYS)
    Workload(**{**row["workload"], "lora": None})  # the workload field round-trips


def fake_peak(case: Case) -> int:
    cfg = case.config()
    model = modelbuild.build_model(cfg, case.workload, device="meta")
    fake_mode = FakeTensorMode()
    modelbuild.fakeify(model, fake_mode)
    vocab = model.get_input_embeddings().num_embeddings
    return trace_step(model, case.workload, vocab_size=vocab, fake_mode=fake_mode).peak_bytes


@pytest.fixture(scope="module")
def cpu_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("gt") / "rows.jsonl"
    assert run.main(["--device", "cpu", "--out", str(out), "--only", *CPU_IDS]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_cpu_rows_parse_and_carry_the_schema(cpu_rows):
    assert [r["id"] for r in cpu_rows] == CPU_IDS
    for r in cpu_rows:
        check_schema(r)
        assert r["status"] == "ok", r["error"]
        assert r["error"] is None and r["device"] == "cpu" and r["runner"] == "tracker-cpu" and r["gpu"] is None
        overrides = r["config_overrides"]
        assert overrides.get("text_config", overrides)["vocab_size"] == 512  # a vision-language config nests it
        assert [s["step"] for s in r["steps"]] == [1, 2]
        allocated = [s["allocated_bytes"] for s in r["steps"]]
        assert allocated == sorted(allocated) and allocated[0] > 0  # running peaks
        assert r["measured"] == {"allocated_bytes": allocated[-1], "reserved_bytes": None, "device_total_bytes": None}
        assert r["env"]["torch"] == torch.__version__ and r["env"]["nvml_source"] is None


@pytest.mark.parametrize("index", range(len(CPU_IDS)))
def test_cpu_measurement_equals_fake_trace(cpu_rows, index):
    (case,) = find([CPU_IDS[index]], CPU_CASES)
    assert cpu_rows[index]["measured"]["allocated_bytes"] == fake_peak(case)


def arch(model: str) -> str:
    return catalog.config_dict(model)["model_type"]


def test_gpu_matrix_covers_the_axes():
    wls = [c.workload for c in GPU_CASES]
    assert len(GPU_CASES) >= 30
    assert len({arch(c.model) for c in GPU_CASES}) >= 5
    assert min(w.seq_len for w in wls) == 512 and max(w.seq_len for w in wls) == 8192
    assert min(w.micro_batch_size for w in wls) == 1 and max(w.micro_batch_size for w in wls) == 16
    assert {"fp32", "bf16-mixed", "bf16"} <= {w.precision.value for w in wls}
    assert {True, False} == {w.grad_checkpointing for w in wls}
    assert {True, False} == {w.lora is not None for w in wls}
    assert {"eager", "sdpa"} <= {w.attn_implementation.value for w in wls}
    assert {"adamw", "adamw-fused"} <= {w.optimizer.value for w in wls}
    assert {"torch", "hf-trainer"} == {c.runner for c in GPU_CASES}
    assert any(w.grad_accum_steps > 1 for w in wls)
    edge = [c for c in GPU_CASES if c.edge]
    assert len(edge) >= 3 and {"fit", "oom"} <= {c.expect for c in edge}
    assert all(c.note for c in edge)


def test_cpu_matrix_covers_the_axes():
    wls = [c.workload for c in CPU_CASES]
    assert len(CPU_CASES) >= 6
    assert len({arch(c.model) for c in CPU_CASES}) >= 3
    assert {w.precision.param_dtype for w in wls} == {torch.float32, torch.bfloat16}
    assert any(w.grad_checkpointing for w in wls) and any(w.lora is not None for w in wls)
    assert all(c.runner == "tracker-cpu" and c.config_overrides for c in CPU_CASES)


def test_cases_are_unique_and_valid():
    cases = GPU_CASES + CPU_CASES
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert c.model in catalog.names()
        d = c.workload.to_dict()
        lora = None if d["lora"] is None else LoraSpec(**{**d["lora"], "target_modules": tuple(d["lora"]["target_modules"])})
        assert Workload(**{**d, "lora": lora}).to_dict() == d


def test_every_gpu_model_builds_with_its_lora_and_attention():
    # LoRA targets that match nothing, or an attention the architecture lacks,
    # would only show as an "error" row on the GPU; catch them on meta.
    # Quantization and flash-attn are built by the real libraries on the GPU
    # (tests/benchmarks/test_techniques.py); on meta their plain model is checked.
    seen = set()
    for c in GPU_CASES:
        attn = "sdpa" if c.workload.attn_implementation.value == "flash_attention_2" else c.workload.attn_implementation
        wl = dataclasses.replace(c.workload, quantize=None, double_quant=False, attn_implementation=attn)
        key = (c.model, wl.lora, wl.attn_implementation)
        if key not in seen:
            seen.add(key)
            modelbuild.build_model(c.config(), wl, device="meta")


def test_case_config_applies_overrides():
    case = next(c for c in CPU_CASES if c.model == "gemma-2-2b")
    cfg = case.config()
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 64 and len(cfg.layer_types) == 2


def test_cuda_without_gpu_is_one_line_and_exit_2(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert run.main(["--device", "cuda", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err
    assert not (tmp_path / "x.jsonl").exists()


def test_unknown_id_lists_the_valid_ones(tmp_path, capsys):
    assert run.main(["--device", "cpu", "--out", str(tmp_path / "x.jsonl"), "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and CPU_CASES[0].id in err and "HINT" in err


def test_cuda_accepts_cpu_case_ids_as_smoke_tests():
    (case,) = run.select_cases("cuda", [CPU_IDS[0]])
    assert case.runner == "torch" and case.id == CPU_IDS[0]


class StubRecorder:
    def __init__(self) -> None:
        self.step_in_progress = 0
        self.resets = 0
        self.steps: list[tuple[int, int]] = []

    def reset(self) -> None:
        self.resets += 1

    def record(self, step: int) -> None:
        self.steps.append((step, self.step_in_progress))


@pytest.mark.parametrize("loop", ["torch", "hf-trainer"])
def test_cuda_training_loops_run_on_cpu(loop):
    case = find(["tiny-opt-125m-fp32-s32-b2-ga2-sdpa"], CPU_CASES)[0]  # with gradient accumulation
    torch.manual_seed(0)
    model = modelbuild.build_model(case.config(), case.workload, device="cpu")
    rec = StubRecorder()
    fn = cuda._trainer_loop if loop == "hf-trainer" else cuda._torch_loop
    fn(model, case, 2, rec, device="cpu")
    assert rec.resets == 1 and rec.steps == [(1, 1), (2, 2)]


def test_worker_crash_and_timeout_become_error_rows():
    (case,) = run.select_cases("cuda", [CPU_IDS[0]])
    timed_out = run._run_in_worker(case, steps=1, timeout_s=0.2)
    check_schema(timed_out)
    assert timed_out["status"] == "error" and "timed out" in timed_out["error"]
    if not torch.cuda.is_available():  # the worker fails to start CUDA and exits
        crashed = run._run_in_worker(case, steps=1, timeout_s=120)
        check_schema(crashed)
        assert crashed["status"] == "error" and "worker exited" in crashed["error"]
        assert crashed["measured"]["allocated_bytes"] is None and crashed["device"] == "cuda"
