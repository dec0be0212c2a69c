"""A frozen reference model beside the policy, as DPO trains (TRL ``DPOTrainer``).

Each micro-batch, after the policy's forward and before its backward, the
reference computes per-sequence log-probabilities of the same tokens under
``torch.no_grad`` (trl/trainer/dpo_trainer.py, trl 1.16, ``_compute_loss``:
``outputs = model(...)`` first, then the reference inside ``torch.no_grad()``).
It runs under the same autocast dtype as the policy forward, in a region of
its own: transformers 5 Trainer leaves autocast to accelerate
(trainer.py, 5.23, ``autocast_smart_context_manager`` returns a null context),
and accelerate's ``prepare_model`` wraps each model's ``forward`` in
``torch.autocast``, whose weight-cast cache is cleared when the call returns.

Which model is the reference (``DPOTrainer.__init__``, trl 1.16):

* a peft (LoRA) policy with no ``ref_model``: the policy itself with its
  adapters disabled (``use_adapter(model, None)`` -> ``model.disable_adapter()``),
  so no weights are added;
* otherwise a second copy of the model loaded with ``dtype=self.model.dtype``
  (the policy's parameter dtype), frozen and put in eval mode
  (``accelerator.prepare_model(ref_model, evaluation_mode=True)``): its
  weights are parameter memory on the device for the whole run.

The log-probabilities are reduced from the reference's full logits with TRL's
``selective_log_softmax`` (trl/trainer/utils.py, trl 1.16, the path without
Triton): fp32/fp64 logits take a ``gather`` plus a ``logsumexp`` per sequence;
half-precision logits a ``log_softmax`` and ``gather`` per sequence ("loop to
reduce peak mem consumption"); then a sum over tokens: the path of TRL before
1.x, and an upper bound. trl 1.16's DPO calls its fused, tiled LM head instead
(``add_fused_lm_head``), which never holds all logits: with ``--loss trl-fused``
the reference runs that head (:func:`llmem_plugin.techniques.trl_head.fused_sequence_logps`)
and the policy DPOTrainer's loss (:func:`llmem_plugin.techniques.trl_head.fused_dpo_loss`).

``micro_batch_size`` counts sequences per forward: DPO concatenates each
prompt's chosen and rejected completions into one batch, so ``b`` pairs are
``micro_batch_size = 2 * b``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn

from llmem_plugin.trace.emulation import autocast_region
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker
from llmem_plugin.workload import Workload

__all__ = ["SUPPORTED_METHODS", "build_reference", "selective_log_softmax", "unsupported"]

# Methods whose traced step runs the reference as the real job would.
SUPPORTED_METHODS = ("single", "ddp")


def unsupported(method: str, workload: Workload) -> str | None:
    """Why ``method`` cannot run ``workload.reference_model``, or None.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload.

    Returns:
        One sentence naming the combination, with a HINT; None if supported.
    """
    if not workload.reference_model or method in SUPPORTED_METHODS:
        return None
    return (
        f"--reference-model is not modelled with method '{method}' (TRL shards or wraps the reference "
        f"separately there); it is with {', '.join(SUPPORTED_METHODS)}. "
        "HINT: drop --reference-model or estimate with --method ddp"
    )


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits).gather(-1, index)`` as TRL computes it without Triton.

    Args:
        logits: ``(batch, seq, vocab)``.
        index: ``(batch, seq)`` token ids.

    Returns:
        ``(batch, seq)`` log-probabilities in the logits' dtype.
    """
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return (selected - lse.unsqueeze(-1)).squeeze(-1)
    rows = [torch.log_softmax(row, dim=-1).gather(dim=-1, index=ids) for row, ids in zip(logits, index)]
    return torch.stack(rows).squeeze(-1)


def _frozen_copy(model: nn.Module, workload: Workload, fake_mode) -> nn.Module:
    """A frozen, eval-mode copy of ``model`` in its parameter dtype; made fake
    in ``fake_mode`` when given (``model`` is then still on meta)."""
    from llmem_plugin.models import modelbuild

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    if fake_mode is not None:
        modelbuild.fakeify(ref, fake_mode)
    return ref


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def build_reference(
    model: nn.Module, workload: Workload, *, tracker: MemoryTracker, fake_mode=None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference forward of ``workload.reference_model`` for ``trace_step(reference=...)``.

    Args:
        model: The policy as built by ``modelbuild.build_model``: on meta
            (before it is made fake) when ``fake_mode`` is given, else real.
        workload: Precision (autocast and parameter dtype) and LoRA.
        tracker: The tracker of the step; a frozen copy's weights are
            registered with it as parameters on the first call.
        fake_mode: The step's ``FakeTensorMode``, or None for a real run.

    Returns:
        A callable taking a micro-batch's input ids and returning the
        per-sequence log-probability sums ``(batch,)`` (the only thing kept).
    """
    from llmem_plugin.workload import LossImpl

    autocast_dtype = workload.precision.autocast_dtype
    fused = workload.loss is LossImpl.TRL_FUSED
    if _is_peft(model):
        ref, weights = model, []
    else:
        ref = _frozen_copy(model, workload, fake_mode)
        weights = list({id(t): t for t in [*ref.parameters(), *ref.buffers()]}.values())
    registered = False

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        nonlocal registered
        if not registered:
            tracker.register(weights, MemoryCategory.PARAMETER)
            registered = True
        adapters_off = ref.disable_adapter() if ref is model else contextlib.nullcontext()
        if fused:
            # trl 1.16: the reference scores the same labels through its fused head (no logits); the policy
            # with its adapters disabled keeps the policy's outputs, a separate copy has the default ones.
            from llmem_plugin.techniques.loss import _causal_lm, _forward_replaced, trl_reference_head
            from llmem_plugin.techniques.trl_head import DPO_OUTPUTS

            causal_lm = _causal_lm(ref)
            head = trl_reference_head(causal_lm, DPO_OUTPUTS if ref is model else ())
            with torch.no_grad(), adapters_off, autocast_region(autocast_dtype), _forward_replaced(causal_lm, head):
                return ref(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        # dpo_trainer: the policy's training flag is not changed for the
        # adapter-disabled reference, so LoRA dropout modules stay as they are.
        with torch.no_grad(), adapters_off, autocast_region(autocast_dtype):
            logits = ref(input_ids=input_ids, use_cache=False).logits
            # The labels are the next tokens (torch.roll, as TRL's
            # concatenated_forward shifts them); the last position is dropped.
            labels = torch.roll(input_ids, shifts=-1, dims=1)
            per_token = selective_log_softmax(logits, labels)
            del logits
            return per_token[:, :-1].sum(-1)

    return forward
