"""Print the arguments TRL 1.16.0's own parser makes of an SFT (or, with ``--dpo``, a DPO) config, as JSON.

Run in a subprocess with trl 1.16.0 on PYTHONPATH (.frameworks/). ``trl sft
--config FILE`` parses with ``TrlParser((ScriptArguments, SFTConfig,
ModelConfig, DatasetMixtureConfig))`` and ``parse_args_and_config``
(trl/scripts/sft.py, trl/scripts/utils.py); keys no dataclass takes go to
``accelerate launch``. Shims that touch no parsed value: pandas and datasets
are stubs (imported at module level by trl's utilities), and ``use_cpu`` is
set because TrainingArguments refuses bf16 on a machine without a GPU. With
``--keys`` it prints the four dataclasses' fields and their defaults instead (``--dpo-keys``: DPOConfig's
own fields, ``--other-keys``: the other trainers' own fields and their config class); with ``--dump FILE`` it
writes an SFTConfig as JSON.
"""

import dataclasses
import importlib.machinery
import json
import os
import sys
import tempfile
import types

for name in ("pandas", "datasets"):
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stub.IterableDataset = stub.Dataset = stub.DataFrame = stub.DatasetDict = stub.IterableDatasetDict = object
    sys.modules[name] = stub

import yaml  # noqa: E402
from trl import DPOConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser  # noqa: E402
from trl.scripts.utils import DatasetMixtureConfig  # noqa: E402

classes = (ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)
if sys.argv[1] in ("--keys", "--dpo-keys"):  # every field with its default (a factory's value), as JSON makes them
    # --dpo-keys: DPOConfig's fields that SFTConfig lacks (`trl dpo` parses DPOConfig in SFTConfig's place)
    sft = {f.name for f in dataclasses.fields(SFTConfig)}
    defaults = {}
    for c in (classes if sys.argv[1] == "--keys" else (DPOConfig,)):
        for f in dataclasses.fields(c):
            if sys.argv[1] == "--dpo-keys" and f.name in sft:
                continue
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = None
            defaults.setdefault(f.name, json.loads(json.dumps(getattr(value, "value", value), default=str)))
    print(json.dumps(dict(sorted(defaults.items()))))
    sys.exit(0)
if sys.argv[1] == "--other-keys":  # the other trainers' own fields -> their config class (first one wins)
    from trl import DistillationConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig

    known = {f.name for c in (*classes, DPOConfig) for f in dataclasses.fields(c)}
    others = {}
    for c in (GRPOConfig, RLOOConfig, KTOConfig, RewardConfig, DistillationConfig):
        for f in dataclasses.fields(c):
            if f.name not in known:
                others.setdefault(f.name, c.__name__)
    print(json.dumps(dict(sorted(others.items()))))
    sys.exit(0)
if sys.argv[1] == "--dump":  # an SFTConfig saved as JSON (to_json_string), as a job's arguments are kept
    config = SFTConfig(output_dir="out", use_cpu=True, per_device_train_batch_size=4, max_length=512)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(config.to_json_string())
    print(json.dumps({"written": sys.argv[2]}))
    sys.exit(0)
with open(sys.argv[1], encoding="utf-8") as f:
    cfg = yaml.safe_load(f)
cfg["use_cpu"] = True
with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
    yaml.safe_dump(cfg, f)
dpo = sys.argv[2:] == ["--dpo"]  # `trl dpo` parses DPOConfig where `trl sft` parses SFTConfig (scripts/dpo.py)
if dpo:
    classes = (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)
script, sft, model, _, rest = TrlParser(classes).parse_args_and_config(
    ["--config", f.name], return_remaining_strings=True)
os.unlink(f.name)
print(json.dumps({
    "model": model.model_name_or_path, "dtype": model.dtype, "attn": model.attn_implementation,
    "use_peft": model.use_peft, "lora_r": model.lora_r, "lora_alpha": model.lora_alpha,
    "lora_dropout": model.lora_dropout, "lora_target_modules": model.lora_target_modules,
    "load_in_4bit": model.load_in_4bit, "load_in_8bit": model.load_in_8bit,
    "quant_type": model.bnb_4bit_quant_type, "nested": model.use_bnb_nested_quant,
    "max_length": sft.max_length, "packing": getattr(sft, "packing", False),
    "packing_strategy": getattr(sft, "packing_strategy", None), "padding_free": sft.padding_free,
    "dpo": dpo, "disable_dropout": getattr(sft, "disable_dropout", False),
    "precompute_ref_log_probs": getattr(sft, "precompute_ref_log_probs", False), "batch": sft.per_device_train_batch_size,
    "accum": sft.gradient_accumulation_steps, "bf16": sft.bf16, "fp16": sft.fp16,
    "gc": sft.gradient_checkpointing, "gc_kwargs": sft.gradient_checkpointing_kwargs,
    "optim": str(getattr(sft.optim, "value", sft.optim)), "activation_offloading": sft.activation_offloading,
    "model_init_kwargs": sft.model_init_kwargs, "loss_type": sft.loss_type, "rest": rest,
}, default=str))
