"""torchtune 0.6.1's own QLoRA setup on the stub CUDA device against the estimate's setup phase.

The stub side runs torchtune's ``lora_llama2`` builder under
``set_default_dtype(bf16)`` and the device, then ``load_state_dict`` of a CPU
checkpoint, as ``recipes/lora_finetune_single_device.py _setup_model`` does,
with torchao 0.18.0's ``to_nf4`` (torchtune 0.6.1 from ``.frameworks``, run in
``.stubvenv``), and reports PyTorch's own ``max_memory_allocated`` and
``max_memory_reserved``. Our side traces transformers' Llama of the same
shapes (``--quantize nf4-torchao``, LoRA r8 on every projection, bf16
adapters) through ``llmem_plugin.trace.loading.load_trace`` and the
simulated allocator (``llmem_plugin.techniques.nf4_setup``, torchtune's RoPE
buffers included). Both peaks and the bytes left at the end should agree.

    python benchmarks/torchtune_setup_stub.py [--out PATH]

writes ``results/stub-torchtune-qlora-setup-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

# One small Llama 2: every projection's element count divides by 64 x 256 (torchao's
# to_nf4), the MLP weights span four of to_nf4's 1024**2-element chunks.
SHAPES = dict(vocab_size=4096, num_layers=2, num_heads=8, num_kv_heads=8, embed_dim=1024, max_seq_len=512,
              intermediate_dim=4096)
LORA = dict(lora_rank=8, lora_alpha=16)

_STUB_SIDE = """
import importlib, json, sys, types
import torch
importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
# torchtune 0.6.1 imports torchao.dtypes.nf4tensor, which torchao 0.18 moved; and its int4/QAT
# helpers need names torchao 0.18 dropped, which the QLoRA path never calls.
sys.modules["torchao.dtypes.nf4tensor"] = sys.modules["torchao.quantization.quantize_.workflows.nf4.nf4_tensor"]
_q = types.ModuleType("torchtune.training.quantization")
_q.__getattr__ = lambda name: type(name, (), {})
sys.modules["torchtune.training.quantization"] = _q
sys.path.extend(PATHS)
from torchtune import training
from torchtune.models.llama2 import lora_llama2

with training.set_default_dtype(torch.bfloat16), torch.device("cuda"):
    model = lora_llama2(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                        apply_lora_to_output=False, quantize_base=True, **KW)
built = {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
# the checkpoint's tensors on the CPU, by parameter name (model.state_dict() would run torchtune's
# post-hook, which dequantizes every NF4 weight on the device)
sd = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in model.named_parameters() if "lora_" not in k}
model.load_state_dict(sd, strict=False)
rope = [b.untyped_storage().nbytes() for _, b in model.named_buffers()]
print(json.dumps({"built": built, "allocated": torch.cuda.max_memory_allocated(),
                  "reserved": torch.cuda.max_memory_reserved(), "final": torch.cuda.memory_allocated(),
                  "rope_buffer_bytes": rope}))
"""


def stub_side() -> dict:
    """torchtune's setup on the stub device (raises ``StubUnavailable`` without it)."""
    from stubcuda import runner

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # torchtune from .frameworks; its package __init__ imports pandas, whose dateutil/pytz
    # the stub venv lacks: the host interpreter's pure-Python copies stand in.
    paths = [os.path.join(root, ".frameworks")] + [p for p in sys.path if p.endswith("site-packages")]
    code = _STUB_SIDE.replace("PATHS", repr(paths)).replace("KW", repr({**SHAPES, **LORA}))
    return runner.run_json(["-c", code + runner.EXIT], timeout_s=900)


def our_side() -> dict:
    """The estimate's setup phase for transformers' Llama of the same shapes."""
    from transformers import LlamaConfig

    from llmem_plugin.device.allocator import replay
    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace import loading
    from llmem_plugin.workload import LoraSpec, Workload

    cfg = LlamaConfig(vocab_size=SHAPES["vocab_size"], hidden_size=SHAPES["embed_dim"],
                      intermediate_size=SHAPES["intermediate_dim"], num_hidden_layers=SHAPES["num_layers"],
                      num_attention_heads=SHAPES["num_heads"], num_key_value_heads=SHAPES["num_kv_heads"],
                      max_position_embeddings=SHAPES["max_seq_len"], tie_word_embeddings=False)
    wl = Workload(seq_len=64, precision="bf16", quantize="nf4-torchao",
                  lora=LoraSpec(rank=LORA["lora_rank"], alpha=LORA["lora_alpha"], adapter_dtype="base",
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj")))
    trace = loading.load_trace(modelbuild.build_model(cfg, wl, device="meta"), wl)
    mark = trace.marks[f"{loading.LOADED_MARK}:setup"]
    res = replay(trace.events[:mark])
    return {"allocated": res.peak_allocated_bytes, "reserved": res.peak_reserved_bytes,
            "final": trace.timeline[mark - 1][2]}


def compare() -> dict:
    """Both sides and their differences (stub minus estimate)."""
    stub, ours = stub_side(), our_side()
    return {"date": str(datetime.date.today()), "shapes": SHAPES, "lora": LORA, "stub": stub, "estimate": ours,
            "diff": {k: stub[k] - ours[k] for k in ("allocated", "reserved", "final")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"stub-torchtune-qlora-setup-{datetime.date.today()}.json")
    result = compare()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
