"""Print the arguments LLaMA-Factory 0.9.5's own parser makes of a training YAML, as JSON.

Run in a subprocess with llamafactory 0.9.5 and omegaconf on PYTHONPATH
(tests/setup.sh installs them to .frameworks/). ``get_train_args``
(hparams/parser.py) parses the YAML into its five argument dataclasses and runs
their post-init rules (lora_alpha from the rank, packing for pt, cutoff_len
under packing, the compute dtype). Three environment shims, none touching a
parsed value: the version check is off (DISABLE_VERSION_CHECK, its own switch:
0.9.5 pins transformers<=5.6); ``datasets`` is a stub holding the one enum the
parser imports (hparams/evaluation_args.py); ``use_cpu: true`` is added because
TrainingArguments refuses bf16 on a machine without a GPU. ``deepspeed`` is
dropped before parsing (the parser insists on a torchrun launch) and read by
the test from the YAML. With ``--keys`` it prints LLaMA-Factory's own argument names instead.
"""

import json
import os
import sys
import types
from enum import Enum

datasets = types.ModuleType("datasets")


class DownloadMode(str, Enum):
    REUSE_DATASET_IF_EXISTS = "reuse_dataset_if_exists"


datasets.DownloadMode = DownloadMode
sys.modules["datasets"] = datasets
os.environ["DISABLE_VERSION_CHECK"] = "1"

import yaml  # noqa: E402
from llamafactory.hparams import get_train_args  # noqa: E402

if sys.argv[1] == "--keys":  # the four LLaMA-Factory dataclasses' fields (TrainingArguments' are transformers')
    import dataclasses

    from llamafactory.hparams import DataArguments, FinetuningArguments, GeneratingArguments, ModelArguments

    print(json.dumps(sorted({f.name for c in (ModelArguments, DataArguments, FinetuningArguments,
                                                GeneratingArguments) for f in dataclasses.fields(c)})))
    sys.exit(0)
with open(sys.argv[1], encoding="utf-8") as f:
    cfg = yaml.safe_load(f)
cfg.pop("deepspeed", None)
cfg["use_cpu"] = True
model_args, data_args, training_args, finetuning_args, _ = get_train_args(cfg)
print(json.dumps({
    "stage": finetuning_args.stage, "finetuning_type": finetuning_args.finetuning_type,
    "cutoff_len": data_args.cutoff_len, "packing": data_args.packing,
    "batch": training_args.per_device_train_batch_size, "accum": training_args.gradient_accumulation_steps,
    "optim": str(getattr(training_args.optim, "value", training_args.optim)),
    "bf16": training_args.bf16, "fp16": training_args.fp16, "pure_bf16": finetuning_args.pure_bf16,
    "lora_rank": finetuning_args.lora_rank, "lora_alpha": finetuning_args.lora_alpha,
    "lora_dropout": finetuning_args.lora_dropout, "lora_target": finetuning_args.lora_target,
    "quantization_bit": model_args.quantization_bit, "quantization_type": model_args.quantization_type,
    "double_quantization": model_args.double_quantization,
    "gradient_checkpointing": not model_args.disable_gradient_checkpointing,
    "use_reentrant_gc": model_args.use_reentrant_gc, "flash_attn": str(getattr(model_args.flash_attn, "value",
                                                                              model_args.flash_attn)),
    "enable_liger_kernel": model_args.enable_liger_kernel, "upcast_layernorm": model_args.upcast_layernorm,
}))
