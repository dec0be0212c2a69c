"""Compare TRL 1.16.0's own fused LM head with llmem_plugin.techniques.trl_head on real CPU tensors; print JSON.

Run in a subprocess with trl 1.16.0 on PYTHONPATH (.frameworks/). A tiny Llama
is built twice from one seed. On the first, TRL's ``add_fused_lm_head``
patches the forward exactly as SFTTrainer does (outputs log_probs, entropy,
is_top1), and SFTTrainer's loss ``-log_probs.sum() / valid`` is
backpropagated. On the second, the backbone's last hidden state goes through
``fused_sft_loss``. Labels ignore some positions (-100), as a prompt mask or a
padding-free collator does. On the CPU, TRL scores every position with torch
ops; the values and gradients must agree all the same.
"""

import importlib.machinery
import json
import sys
import types

import torch
import transformers

# trl/trainer/utils.py imports pandas and datasets at module level for its dataset helpers; neither is
# used by the fused head, and neither is installed here.
for name in ("pandas", "datasets"):
    stub = types.ModuleType(name)
    stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stub.IterableDataset = stub.Dataset = stub.DataFrame = object
    sys.modules[name] = stub
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from llmem_plugin.techniques.trl_head import fused_sft_loss


def model(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=40000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).float()


torch.manual_seed(1)
ids = torch.randint(0, 40000, (2, 24))
labels = ids.clone()
labels[0, :5] = -100
labels[1, 10] = -100
results = {}
trl_model = model(0)
add_fused_lm_head(trl_model, outputs=("log_probs", "entropy", "is_top1"))
out = trl_model(input_ids=ids, labels=labels, fused_lm_head=True)
valid = out.label_mask.sum()
trl_loss = -out.log_probs.sum() / valid
trl_loss.backward()
ours = model(0)
hidden = ours.model(input_ids=ids).last_hidden_state
our_loss = fused_sft_loss(hidden, ours.lm_head.weight, labels)
our_loss.backward()
grads = {}
for (name, a), (_, b) in zip(trl_model.named_parameters(), ours.named_parameters()):
    grads[name] = float((a.grad - b.grad).abs().max() / (a.grad.abs().max() + 1e-30))
print(json.dumps({"trl_loss": float(trl_loss), "our_loss": float(our_loss), "grad_rel_err": grads,
                  "valid": int(valid)}))
