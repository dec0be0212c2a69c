"""Sample lengths of torchtune 0.1's ``alpaca_cleaned_dataset`` under the Llama 2 tokenizer.

The torchtune LoRA tutorial rows (``tt-lora-tut-*``) trained on
``alpaca_cleaned_dataset`` with ``max_seq_len`` 512, batches of 2 padded to
their longer sample (``utils.padded_collate``) and a shuffling sampler. This
script writes each sample's token count, untruncated (the estimate caps at
the workload's ``seq_len``), one per line, for ``--seq-lens``.

What it reproduces, read in torchtune at ff594c231 (the tutorial's commit):

- ``AlpacaInstructTemplate`` (torchtune/data/_instruct_templates.py): the
  prompt with or without the input paragraph;
- ``InstructDataset._prepare_sample`` (torchtune/datasets/_instruct.py): a
  user message (the prompt) and an assistant message (the output);
- ``Tokenizer.tokenize_messages`` (torchtune/modules/tokenizer.py): BOS, the
  prompt's tokens (``rstrip(" ")``), the output's tokens with the leading
  whitespace trimmed (encoded after a ``"\\n"`` prefix, whose tokens are cut
  off, because the prompt does not end with a space and the vocabulary
  encodes whitespace), then EOS.

Inputs (neither is shipped; both are public):

- ``--data``: an alpaca-cleaned JSON list (instruction/input/output). The
  committed lengths come from the English splits of gururise's
  ``alpaca_data_cleaned.json`` as of 2023-03-24 kept in GitHub
  NanoCode012/alpaca-khmer (``dataset_splits/alpaca_data_cleaned_{0..35}.json``
  at 1b60a188), 50,921 records: the Hub copy torchtune loads
  (``yahma/alpaca-cleaned``, about 51.7k) is not reachable from here, and
  those splits lack about 2% of its records.
- ``--tokenizer``: Llama 2's ``tokenizer.model`` (sha256 9e556afd...d347,
  the file GitHub karpathy/llama2.c ships).

Run: ``python -m benchmarks.published.alpaca_lengths --data FILE.json
--tokenizer tokenizer.model --out benchmarks/published/lengths/alpaca-cleaned-llama2.txt``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def sample_length(sp, sample: dict) -> int:
    """Tokens torchtune 0.1 makes of one sample, before truncation."""
    if sample.get("input"):
        prompt = _PROMPT_INPUT.format(instruction=sample["instruction"], input=sample["input"])
    else:
        prompt = _PROMPT_NO_INPUT.format(instruction=sample["instruction"])
    n = 1 + len(sp.encode(prompt.rstrip(" ")))  # BOS, the user message
    prefix = len(sp.encode("\n"))
    n += len(sp.encode("\n" + sample["output"].rstrip(" "))) - prefix  # leading whitespace trimmed
    return n + 1  # EOS


def main(argv: list[str] | None = None) -> None:
    import sentencepiece

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="alpaca-cleaned JSON list")
    ap.add_argument("--tokenizer", required=True, help="Llama 2 tokenizer.model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sp = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer)
    samples = json.loads(Path(args.data).read_text())
    lengths = [sample_length(sp, s) for s in samples]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(f"{n}\n" for n in lengths))
    over = sum(n > 512 for n in lengths)
    print(f"{len(lengths)} samples, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}, "
          f"{over} over 512 tokens -> {args.out}")


if __name__ == "__main__":
    main()
