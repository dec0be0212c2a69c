"""The CUDA runners: real fine-tuning steps on one GPU, in the worker process of one case.

``run.py`` starts one worker process per case, so the peak statistics, the
allocator's cache and the CUDA context start clean and an OOM cannot poison
later cases. The worker builds the model with
``llmem_plugin.models.modelbuild.build_model(config, workload, device="cuda")`` --
the same function, so the same model, the estimator traces on meta -- with
random weights (nothing is downloaded); where the estimator traces stand-ins
(bitsandbytes, flash-attn, liger-kernel, TRL) the real libraries are used
instead (:mod:`benchmarks.groundtruth.techniques`). It then runs ``steps``
optimizer steps:

* "torch": the loop ``llmem_plugin.trace.step`` models, with the optimizer of
  ``llmem_plugin.trace.step.make_optimizer`` (bitsandbytes' own for its kinds).
* "hf-trainer": ``transformers.Trainer``. Mixed precision sets ``bf16=True`` /
  ``fp16=True`` over fp32 weights; pure bf16 loads the model in bf16 and sets
  neither (Trainer has no pure-bf16 switch).

After every step it records ``max_memory_allocated``, ``max_memory_reserved``
(peaks since just before the first step) and the device's used memory (NVML,
else ``total - free`` from ``torch.cuda.mem_get_info``). All torch.cuda and
pynvml use stays inside this module's functions.

Known limitations:
    * NVML used memory is device-wide: other processes on the GPU count too.
    * The NVML device is picked from ``CUDA_VISIBLE_DEVICES`` and re-checked
      by UUID once CUDA is up; with a mismatch ``idle_used_bytes`` is null.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable

from benchmarks.groundtruth import rows, techniques
from benchmarks.groundtruth.matrix import TRAINER_OPTIM, Case

__all__ = ["run_case"]

# HF Trainer's default learning rate (TrainingArguments.learning_rate), as llmem_plugin.trace.step.
_LR = 5e-5
# A folder: each case's allocator history from the peak reset on is dumped there as a snapshot.
SNAPSHOT_ENV = "LLMEM_STUB_SNAPSHOT_DIR"
SNAPSHOT_STACKS_ENV = "LLMEM_STUB_SNAPSHOT_STACKS"  # "python": the dumped entries carry Python frames


class _Nvml:
    """The NVML handle of the GPU this process uses."""

    source = "nvml"

    def __init__(self, pynvml, handle) -> None:
        self._nvml = pynvml
        self._handle = handle

    @classmethod
    def open(cls, uuid: str | None = None) -> _Nvml | None:
        """NVML for the GPU with ``uuid``, else the first visible one; None without pynvml or NVML."""
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            if uuid:
                handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + uuid.removeprefix("GPU-"))
            elif first.startswith("GPU-"):
                handle = pynvml.nvmlDeviceGetHandleByUUID(first)
            elif first.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
            else:  # a MIG instance: NVML's device-wide numbers would not be this process's
                return None
            return cls(pynvml, handle)
        except Exception:  # noqa: BLE001 - pynvml missing, no driver library, no such device
            return None

    def matches(self, torch_uuid: str | None) -> bool:
        """Whether this handle is the device torch calls ``cuda:0`` (True when torch gives no UUID)."""
        if not torch_uuid:
            return True
        uuid = self._nvml.nvmlDeviceGetUUID(self._handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        return uuid.removeprefix("GPU-") == torch_uuid.removeprefix("GPU-")

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def total(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).total)

    def driver(self) -> str:
        v = self._nvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v


class _Recorder:
    """Reads the three numbers after each step and reports the row as it grows."""

    def __init__(self, row: dict, nvml: _Nvml | None, progress: Callable[[dict], None], *,
                 device_used: bool = True) -> None:
        self.row = row
        self.nvml = nvml
        self.progress = progress
        self.device_used = device_used  # False on the stub device: its used memory is not a GPU's
        self.step_in_progress = 0  # 0: before the first step (model build, optimizer)

    def reset(self) -> None:
        """Start the peaks from here: drop what model construction left in the allocator's cache."""
        import torch

        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if os.environ.get(SNAPSHOT_ENV):
            # The allocator's history from here on (no stacks: the comparison is of the actions), dumped
            # when the case ends (run_case): tests/stub/test_snapshot.py sets it against the predicted one.
            # LLMEM_STUB_SNAPSHOT_STACKS=python adds each entry's Python frames (to read a difference).
            torch.cuda.memory._record_memory_history(
                max_entries=4_000_000, context="alloc" if os.environ.get(SNAPSHOT_STACKS_ENV) else None,
                stacks=os.environ.get(SNAPSHOT_STACKS_ENV) or "all")

    def record(self, step: int) -> None:
        import torch

        torch.cuda.synchronize()
        if not self.device_used:
            used = None
        elif self.nvml is not None:
            used = self.nvml.used()
        else:
            free, total = torch.cuda.mem_get_info()
            used = total - free
        self.row["steps"].append(rows.step_record(
            step, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), used))
        self.progress(self.row)
        _dump_snapshot(self.row["id"])  # after every step: the last one written ends with the last step


def _dump_snapshot(case_id: str) -> None:
    """With ``SNAPSHOT_ENV`` set to a folder: the allocator's recorded history to ``FOLDER/<case id>.pickle``."""
    folder = os.environ.get(SNAPSHOT_ENV)
    if folder:
        import torch

        torch.cuda.memory._dump_snapshot(os.path.join(folder, f"{case_id}.pickle"))


def _gpu_info(nvml: _Nvml | None, idle_used: int | None) -> dict:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "memory_bytes": nvml.total() if nvml is not None else int(props.total_memory),
        "compute_capability": list(torch.cuda.get_device_capability(0)),
        # NVML used memory before this process created its CUDA context.
        "idle_used_bytes": idle_used,
    }


def _autocast(dtype, device: str):
    import torch

    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _vocab(model) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def _torch_loop(model, case: Case, steps: int, rec: _Recorder, *, device: str = "cuda") -> None:
    """The plain loop of ``llmem_plugin.trace.step.trace_step``, for real, ``steps`` times.

    The optimizer, loss, activation offload and reference forward are the
    real libraries' (:mod:`benchmarks.groundtruth.techniques`), in the order
    ``trace_step`` runs them: per micro-batch the reference forward, then,
    inside the offload context, the policy forward with its loss and the
    backward. ``device`` is "cuda" here; the tests run the same loop on the CPU.
    """
    import torch

    from llmem_plugin.models.tasks import extra_inputs, make_labels

    wl = case.workload
    optimizer = techniques.make_optimizer([p for p in model.parameters() if p.requires_grad], wl.optimizer)
    reference = techniques.reference_forward(model, wl)  # a frozen copy is resident from here
    offload = techniques.offload_factory(model, wl)
    vocab, dtype = _vocab(model), wl.precision.autocast_dtype
    gen = torch.Generator(device=device).manual_seed(0)
    lengths = [[wl.seq_len] * wl.grad_accum_steps] * steps
    if case.seq_lens is not None:  # each micro-batch padded to its longest sample (llmem_plugin.techniques.varlen)
        from llmem_plugin.techniques.varlen import parse_lengths, step_lengths

        lengths = step_lengths(parse_lengths(case.seq_lens), micro_batch_size=wl.micro_batch_size,
                               grad_accum_steps=wl.grad_accum_steps, max_len=wl.seq_len, steps=steps)
    # A hand-written loop keeps the last micro-step's outputs until the next forward's replace them.
    plain = wl.runner.value == "plain-loop"
    previous: list = []  # what the loop still binds of the last micro-step; cleared where it rebinds its name
    rec.reset()
    for step in range(1, steps + 1):
        rec.step_in_progress = step
        for micro in range(wl.grad_accum_steps):
            shape = (wl.micro_batch_size, lengths[step - 1][micro])
            input_ids = torch.randint(0, vocab, shape, device=device, generator=gen)
            labels = make_labels(model, input_ids, wl).to(device)  # the task's labels (llmem_plugin.models.tasks)
            extra = {k: v.to(device) for k, v in extra_inputs(model, input_ids, wl).items()}
            ref_logps = None
            if reference is not None:
                # DPO (TRL): the reference forward under the same autocast; only its log-probs are kept.
                with _autocast(dtype, device):
                    ref_logps = reference(input_ids)
            with offload():
                # As HF Trainer's compute_loss: forward and loss under autocast, backward outside.
                held = [] if plain else None
                with _autocast(dtype, device):
                    loss = techniques.forward_loss(model, input_ids, labels, wl, extra, hold=held,
                                                   release=previous.clear if plain else None) / wl.grad_accum_steps
                if plain:
                    previous[:] = held  # alive until the next micro-step's outputs replace it
                loss.backward()
            del loss, input_ids, labels, ref_logps, extra
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rec.record(step)
    del previous


def _trainer_args(case: Case, steps: int, output_dir: str, *, device: str = "cuda") -> dict:
    import dataclasses

    import transformers

    from llmem_plugin.workload import Precision

    wl = case.workload
    kw = {
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": wl.micro_batch_size,
        "gradient_accumulation_steps": wl.grad_accum_steps,
        # Mixed precision over fp32 weights; pure bf16 is the bf16 model with neither flag.
        "bf16": wl.precision is Precision.BF16_MIXED,
        "fp16": wl.precision is Precision.FP16_MIXED,
        "optim": TRAINER_OPTIM[wl.optimizer.value],
        "learning_rate": _LR,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "disable_tqdm": True,
        "seed": 0,
    }
    if device == "cpu":  # the tests only
        kw["use_cpu"] = True
    if wl.grad_checkpointing:
        # transformers 5 renamed gradient_checkpointing to activation_checkpointing (old name: deprecated alias).
        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        kw[name] = True
        kw[f"{name}_kwargs"] = {"use_reentrant": False}
    return kw


def _trainer_loop(model, case: Case, steps: int, rec: _Recorder, *, device: str = "cuda") -> None:
    """``steps`` optimizer steps of ``transformers.Trainer`` on random token ids (CPU: the tests only)."""
    import torch
    import transformers

    wl = case.workload
    num = steps * wl.micro_batch_size * wl.grad_accum_steps
    ids = torch.randint(0, _vocab(model), (num, wl.seq_len), generator=torch.Generator().manual_seed(0))

    class _Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return num

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": ids[i], "labels": ids[i].clone()}

    class _Callback(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            rec.reset()

        def on_step_begin(self, args, state, control, **kwargs):
            rec.step_in_progress = state.global_step + 1

        def on_step_end(self, args, state, control, **kwargs):
            rec.record(state.global_step)

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(**_trainer_args(case, steps, tmp, device=device))
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[_Callback()])
        trainer.train()


def run_case(case: Case, *, steps: int, progress: Callable[[dict], None] = lambda row: None,
             stub: dict | None = None) -> dict:
    """Run ``case`` on ``cuda:0`` and return its row.

    Args:
        case: A case whose runner is "torch" or "hf-trainer".
        steps: Optimizer steps to run.
        progress: Called with the (unfinished) row whenever it changes, so a
            killed worker leaves what it measured.
        stub: Set when ``cuda:0`` is the stub device
            (:mod:`benchmarks.groundtruth.stub`): what the row records about
            it. The row's ``device`` is then "stub", and the device's used
            memory is not read (null).

    Returns:
        The finished row: status "ok", "oom" (``torch.OutOfMemoryError``; its
        last ``steps`` entry is read at the failure, for the step in
        progress, 0 if before the first), "skipped" (a library the case
        needs is missing; ``error`` says which) or "error".
    """
    import torch

    t0 = time.perf_counter()
    nvml = _Nvml.open() if stub is None else None
    idle_used = nvml.used() if nvml is not None else None  # before this process's CUDA context exists
    torch.cuda.init()
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
    if nvml is not None and not nvml.matches(uuid):
        nvml, idle_used = _Nvml.open(uuid), None
    if stub is None:
        env = rows.environment(driver=nvml.driver() if nvml is not None else None,
                               nvml_source=_Nvml.source if nvml is not None else "mem_get_info")
    else:
        env = rows.environment()
    row = rows.new_row(case, device="cuda" if stub is None else "stub", runner=case.runner, env=env,
                       gpu=_gpu_info(nvml, idle_used), stub=stub)
    progress(row)
    rec = _Recorder(row, nvml, progress, device_used=stub is None)
    try:
        torch.manual_seed(0)
        model = techniques.build_model(case, device="cuda")
        loop = _trainer_loop if case.runner == "hf-trainer" else _torch_loop
        loop(model, case, steps, rec)
        return rows.finish(row, status="ok", error=None, seconds=time.perf_counter() - t0)
    except techniques.Skipped as e:
        return rows.finish(row, status="skipped", error=str(e)[:500], seconds=time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        with contextlib.suppress(Exception):  # the row must still be written
            rec.record(rec.step_in_progress)
        return rows.finish(row, status="oom", error=rows.error_text(e), seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a failing case is a row, not a crash of the matrix
        import traceback

        traceback.print_exc()
        return rows.finish(row, status="error", error=rows.error_text(e), seconds=time.perf_counter() - t0)
