"""Print what torchtune 0.6.1's own config loader builds from a recipe YAML, as JSON.

Run in a subprocess with torchtune 0.6.1, omegaconf 2.3 and antlr4 4.9.3 on
PYTHONPATH (tests/setup.sh installs them to .frameworks/): the YAML is loaded
with OmegaConf as ``tune run`` does (config/_parse.py), and the model, loss
and optimizer are built with ``torchtune.config.instantiate`` on the meta
device under the recipe's dtype (lora_finetune_single_device.py builds the
model under ``set_default_dtype(dtype)``).

Two import shims, neither touching what is counted: torchao 0.18 moved
NF4Tensor (torchao.dtypes.nf4tensor -> torchao.quantization), and torchtune's
package __init__ imports ``datasets`` for its dataset builders only.
"""

import importlib
import json
import sys
import types

import torch

nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

sys.modules["torchao.dtypes.nf4tensor"] = nf4
datasets = types.ModuleType("datasets")
datasets.__path__ = []  # a package, for `from datasets.distributed import ...`
datasets.load_dataset = datasets.Dataset = None
distributed = types.ModuleType("datasets.distributed")
distributed.split_dataset_by_node = None
sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})

from omegaconf import OmegaConf  # noqa: E402
from torchtune import config  # noqa: E402
from torchtune.modules.peft import get_adapter_params, set_trainable_params  # noqa: E402

cfg = OmegaConf.load(sys.argv[1])
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
torch.set_default_dtype(dtype)
with torch.device("meta"):
    model = config.instantiate(cfg.model)
adapter = get_adapter_params(model)
if adapter:
    set_trainable_params(model, adapter)
out = {
    "params": sum(p.numel() for p in model.parameters()),
    "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    "adapter_dtypes": sorted({str(p.dtype) for p in adapter.values()}),
    "lora_layers": sorted({n.rsplit(".", 3)[-3] for n in adapter if n.endswith("lora_a.weight")}),
    "nf4_weights": sum(isinstance(p, nf4.NF4Tensor) for p in model.parameters()),
    "layers": len(model.layers),
}
loss = config.instantiate(cfg.loss)
out["loss"] = type(loss).__name__
out["loss_chunks"] = getattr(loss, "num_output_chunks", None)
opt = config.instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1, device="meta"))])
out["optimizer"] = type(opt).__module__ + "." + type(opt).__name__
out["fused"] = bool(opt.defaults.get("fused"))
print(json.dumps(out))
