"""What the live TRL probes share (trl_sft_live.py, trl_dpo_live.py): the tiny model and its tokenizer, the
callback, and the run's report as the JSON line the tests read."""

import json
import sys
import warnings
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from llmem_plugin.integrations.hf import LLMemCallback  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402


def model(dtype: str):
    """The tiny Llama (sdpa), seeded; bf16 weights for ``dtype`` "bf16"."""
    import torch
    import transformers

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    return m.to(torch.bfloat16) if dtype == "bf16" else m


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Words w2..w{vocab-1}, pad <pad> (0) and EOS </s> (1). Special tokens are matched inside words, so none
    is a prefix of another word."""
    words = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}},
                                       unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")


def callback() -> LLMemCallback:
    """Checked for an H100; compared after the second optimizer step; no file written."""
    return LLMemCallback(gpu="h100-sxm", compare_after_steps=2, record_file=False)


def train_and_report(trainer, cb: LLMemCallback) -> None:
    """Train, then print the llmem warnings, the steps run, and the predicted and measured peaks."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    out = {"warnings": [str(w.message) for w in caught if "llmem" in str(w.message)],
           "steps": trainer.state.global_step, "predicted": None, "measured": None, "workload": None}
    if cb.comparison is not None:
        out.update(predicted=cb.comparison.prediction.tensor_bytes,
                   measured=cb.comparison.measurement.allocated_bytes, workload=cb.comparison.prediction.workload)
    print(json.dumps(out))
