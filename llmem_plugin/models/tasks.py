"""Which model class a config names, and whether its training step is modelled.

A config's ``architectures[0]`` names the class its checkpoint was saved
from, which is the class a user fine-tunes (``AutoModelFor*.from_pretrained``
builds it). transformers' auto-class tables
(``transformers/models/auto/modeling_auto.py``, ``MODEL_FOR_*_MAPPING_NAMES``)
say which task each class serves. Two tasks are modelled:

- ``causal-lm``: next-token loss over the sequence (the default when a config
  names no class, as transformers' ``AutoModelForCausalLM`` builds it);
- ``seq-cls``: a sequence classifier, labels of shape ``[batch]``
  (``num_labels`` from the config; one label is regression, as transformers'
  ``problem_type`` rule has it);
- ``token-cls``: a token classifier, labels ``[batch, seq_len]`` of
  ``num_labels`` classes;
- ``masked-lm``: an encoder's masked-LM fine-tuning, labels ``[batch,
  seq_len]`` (a collator sets the unmasked positions to -100; the logits and
  the loss are computed over every position either way);
- ``image-text-to-text``: a vision-language model, for the model types
  whose inputs are built here (Mllama: :func:`extra_inputs`);
- ``seq2seq``: an encoder-decoder, source ids ``[batch, seq_len]`` and target
  labels ``[batch, target_len]``; the model makes its decoder inputs by
  shifting the labels right (``shift_tokens_right`` / ``_shift_right``), as
  in transformers' seq2seq fine-tuning.

Every other class is refused in one line: estimating its decoder as a causal
LM would estimate another model. ``Workload.task`` (``--task``) overrides the
config's class, for a checkpoint saved as one class and fine-tuned as another
(a base model's config under a classifier).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import UnsupportedError
from llmem_plugin.workload import Task

__all__ = ["auto_class", "check_workload", "config_task", "extra_inputs", "image_note", "make_labels", "model_task"]


_AUTO_CLASS = {Task.CAUSAL_LM: "AutoModelForCausalLM", Task.SEQ_CLS: "AutoModelForSequenceClassification",
               Task.TOKEN_CLS: "AutoModelForTokenClassification", Task.SEQ2SEQ: "AutoModelForSeq2SeqLM",
               Task.IMAGE_TEXT: "AutoModelForImageTextToText", Task.MASKED_LM: "AutoModelForMaskedLM"}
# transformers' table of each modelled task's classes.
_TABLE = {Task.CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
          Task.SEQ_CLS: "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
          Task.TOKEN_CLS: "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
          Task.SEQ2SEQ: "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
          # After seq2seq: the masked-LM table also lists BartForConditionalGeneration.
          Task.MASKED_LM: "MODEL_FOR_MASKED_LM_MAPPING_NAMES"}
# Vision-language classes whose step inputs extra_inputs builds; the other
# image-text-to-text classes are refused.
_IMAGE_TEXT_CLASSES = ("MllamaForConditionalGeneration",)

# Tasks that take more than token ids (images, a separate target sequence) or
# another head; checked before the causal-LM table, which also lists some
# multimodal classes (Gemma3ForConditionalGeneration).
_REFUSED = (
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
     f"a vision-language model (image-text-to-text) other than {', '.join(_IMAGE_TEXT_CLASSES)}"),
    ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "a multimodal model"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "a speech seq2seq model"),
)
_OTHER = (
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "a question-answering model"),
    ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "a multiple-choice model"),
    ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "a pretraining head"),
)


@functools.cache
def _classes(table: str) -> frozenset[str]:
    from transformers.models.auto import modeling_auto

    out: set[str] = set()
    for v in getattr(modeling_auto, table, {}).values():
        out.update(v if isinstance(v, (list, tuple)) else (v,))
    return frozenset(out)


def auto_class(task: Task) -> Any:
    import transformers

    return getattr(transformers, _AUTO_CLASS[task])


def _classify(name: str) -> Task | str | None:
    """The modelled task of class ``name``, what it is when it is not modelled,
    or None when transformers' tables do not list it."""
    if name in _IMAGE_TEXT_CLASSES:
        return Task.IMAGE_TEXT
    what = next((w for table, w in _REFUSED if name in _classes(table)), None)
    if what is not None:
        return what
    for task, table in _TABLE.items():
        if name in _classes(table):
            return task
    return next((w for table, w in _OTHER if name in _classes(table)), None)


def _refuse(name: str, what: str | None) -> UnsupportedError:
    if what and ("vision-language" in what or "multimodal" in what):
        # Its text model's config (text_config) names no class: a causal LM.
        hint = ("for a text-only fine-tune, pass its text model's config (the text_config section) as its own "
                "config.json")
    else:
        hint = "pass --task (task=) with the one the job trains, e.g. --task causal-lm for a decoder"
    return UnsupportedError(
        f"{name}{f' is {what}' if what else ' is not a class transformers lists for a task'}: its training step "
        f"is not modelled, and a causal LM in its place would be another model. Modelled tasks: "
        f"{', '.join(t.value for t in Task)}. HINT: {hint}")


def _language_model_task(config: Any) -> Task | None:
    """The language-model task of ``config``'s model type, for a config that
    names no head (no ``architectures``, or a bare ``*Model`` such as
    bart-base's ``BartModel``): seq2seq for an encoder-decoder, causal LM for
    a decoder. None for an encoder (a type with a masked-LM class: BERT's
    ``BertLMHeadModel`` is not how it is fine-tuned), where the head must be
    named."""
    import transformers

    kind = type(config)
    if getattr(config, "is_encoder_decoder", False) and kind in auto_class(Task.SEQ2SEQ)._model_mapping:
        return Task.SEQ2SEQ
    if kind in auto_class(Task.CAUSAL_LM)._model_mapping and kind not in transformers.AutoModelForMaskedLM._model_mapping:
        return Task.CAUSAL_LM
    return None


def config_task(config: Any, override: Task | str | None = None) -> Task:
    """The task to trace for ``config``: ``override`` if given, else that of
    the class ``config.architectures[0]`` names, else (no class named) the
    model type's (causal LM first, as ``AutoModelForCausalLM`` would build).

    Raises:
        UnsupportedError: A class whose training step is not modelled.
        ConfigError: An override the model type has no class for.
    """
    from llmem_plugin.errors import ConfigError

    if override is not None:
        task = Task(override)
        if type(config) not in auto_class(task)._model_mapping:
            raise ConfigError(f"model type {getattr(config, 'model_type', '?')!r} has no {task.value} class in "
                              f"transformers ({_AUTO_CLASS[task]}). HINT: pass another --task, or drop it")
        if task is Task.IMAGE_TEXT:
            name = auto_class(task)._model_mapping[type(config)].__name__
            if name not in _IMAGE_TEXT_CLASSES:
                raise _refuse(name, _classify(name) if isinstance(_classify(name), str) else None)
        return task
    archs = getattr(config, "architectures", None)
    name = archs[0] if isinstance(archs, (list, tuple)) and archs and isinstance(archs[0], str) else None
    if name is None or name in _classes("MODEL_MAPPING_NAMES"):
        task = _language_model_task(config)
        if task is not None:
            return task
        if name is None and type(config) not in __import__("transformers").AutoModelForMaskedLM._model_mapping:
            return Task.CAUSAL_LM  # no class of its own: AutoModelForCausalLM says what is wrong
        raise UnsupportedError(
            f"the config names no head ({name or 'no architectures'}) and model type "
            f"{getattr(config, 'model_type', '?')!r} is an encoder: the head the job trains decides the step. "
            "HINT: pass --task masked-lm, seq-cls or token-cls (task= in the API), or a config whose "
            "architectures names the class")
    task = _classify(name)
    if isinstance(task, Task):
        return task
    if task is None and name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")):
        # A class outside transformers' tables (remote code, or an old name
        # such as T5WithLMHeadModel): the model type's language-model class.
        by_type = _language_model_task(config)
        if by_type is not None:
            return by_type
    raise _refuse(f"the config's architectures[0], {name},", task)


def model_task(model: nn.Module) -> Task:
    """The task of a built model: that of the first class in its MRO that
    transformers' tables list (a peft wrapper's base model counts); a causal
    LM if none is listed.

    Raises:
        UnsupportedError: A class whose training step is not modelled.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cls in type(base).__mro__:
        task = _classify(cls.__name__)
        if isinstance(task, Task):
            return task
        if task is not None:
            raise _refuse(type(base).__name__, task)
    return Task.CAUSAL_LM


def make_labels(model: nn.Module, input_ids: torch.Tensor, workload: Any) -> torch.Tensor:
    """The labels a fine-tuning batch carries for ``model``'s task: the token
    ids (causal LM); one class per token (token classifier); one class per sequence (``num_labels`` classes; a float
    target for one label, regression, as transformers' ``problem_type`` rule
    in ``*ForSequenceClassification.forward``); target token ids of
    ``workload.target_len`` (seq2seq)."""
    task = model_task(model)
    if task in (Task.CAUSAL_LM, Task.IMAGE_TEXT, Task.MASKED_LM):  # shapes as the token ids'
        return input_ids.clone()
    b = input_ids.shape[0]
    if task is Task.TOKEN_CLS:
        return torch.zeros_like(input_ids)
    if task is Task.SEQ2SEQ:
        t = workload.target_len or input_ids.shape[1]
        vocab = model.get_input_embeddings().num_embeddings
        from torch._subclasses.fake_tensor import is_fake

        gen = None if is_fake(input_ids) else torch.Generator().manual_seed(1)
        return torch.randint(0, vocab, (b, t), generator=gen)
    num_labels = int(getattr(model.config, "num_labels", 2))
    if num_labels == 1:
        return torch.zeros(b, dtype=torch.float32)
    return torch.zeros(b, dtype=torch.long)


def extra_inputs(model: nn.Module, input_ids: torch.Tensor, workload: Any) -> dict[str, torch.Tensor]:
    """The inputs besides ``input_ids`` and ``labels`` a batch of ``model``'s task carries.

    Mllama (``MllamaProcessor``, transformers/models/mllama/processing_mllama.py
    and image_processing_mllama.py): each image is resized into up to
    ``max_num_tiles`` tiles of ``image_size`` pixels square; the batch holds
    ``pixel_values`` ``[batch, images, tiles, 3, size, size]`` (float32, as
    the image processor returns them), ``aspect_ratio_ids`` ``[batch,
    images]``, ``aspect_ratio_mask`` ``[batch, images, tiles]`` and
    ``cross_attention_mask`` ``[batch, seq_len, images, tiles]`` (int64).
    Every image is taken at ``max_num_tiles`` tiles, the most the processor
    makes (an image whose aspect ratio uses them all): the worst case.
    Other tasks carry nothing more.
    """
    if model_task(model) is not Task.IMAGE_TEXT:
        return {}
    vision = model.config.vision_config
    b, s = input_ids.shape
    images = workload.images or 1
    tiles, size = int(vision.max_num_tiles), int(vision.image_size)
    return {
        "pixel_values": torch.zeros(b, images, tiles, 3, size, size, dtype=torch.float32),
        "aspect_ratio_ids": torch.ones(b, images, dtype=torch.long),
        "aspect_ratio_mask": torch.ones(b, images, tiles, dtype=torch.long),
        "cross_attention_mask": torch.ones(b, s, images, tiles, dtype=torch.long),
    }


def image_note(config: Any, workload: Any) -> str | None:
    """One line on the images a vision-language estimate assumes (None for other models)."""
    vision = getattr(config, "vision_config", None)
    try:
        if vision is None or config_task(config, workload.task) is not Task.IMAGE_TEXT:
            return None
    except Exception:  # noqa: BLE001 - not a modelled class: no note
        return None
    images = workload.images or 1
    tower = "frozen" if workload.freeze_vision else "trained"
    return (f"vision-language: {images} image{'s' * (images > 1)} per sample, each at the image processor's most "
            f"tiles ({vision.max_num_tiles} of {vision.image_size}x{vision.image_size} px: the worst case); "
            f"vision tower {tower}")


def check_workload(task: Task, workload: Any) -> None:
    """Refuse, in one line, workload options that exist for causal LMs only.

    Raises:
        ConfigError: A loss variant, ``logits_to_keep``, a reference model or
            ``target_len`` the task does not have.
    """
    from llmem_plugin.errors import ConfigError

    if task is not Task.CAUSAL_LM:
        if workload.loss.value != "hf" or workload.logits_to_keep:
            raise ConfigError(f"--loss {workload.loss.value} / --logits-to-keep are next-token losses of causal LMs; "
                              f"this is a {task.value} model. HINT: drop them (the model's own loss is traced)")
        if workload.reference_model:
            raise ConfigError(f"a reference model (DPO) is modelled for causal LMs; this is a {task.value} model. "
                              "HINT: drop --reference-model")
    if task is not Task.IMAGE_TEXT and (workload.images is not None or workload.freeze_vision):
        raise ConfigError(f"--images / --freeze-vision are options of vision-language models; this is a "
                          f"{task.value} model. HINT: drop them")
    if task is not Task.SEQ2SEQ and workload.target_len is not None:
        raise ConfigError(f"--target-len is the target length of seq2seq models; this is a {task.value} model. "
                          "HINT: drop --target-len (--seq-len is its sequence length)")

