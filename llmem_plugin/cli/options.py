"""The options the ``llmem`` commands share, and the job they describe.

The parser class whose errors are one line with a HINT, the bounded integer
and float option types (each bound with its reason), the argument groups of
the workload, GPU and host, the checks that refuse bad or contradictory
options before anything is built, and the :class:`~llmem_plugin.workload.Workload`
made from them. Nothing here imports torch: ``llmem --help`` and option errors
are answered before it loads.
"""

from __future__ import annotations

import argparse
import math
import sys

__all__ = [
    "EFFICIENCY",
    "EXIT_BAD_INPUT",
    "EXIT_WONT_FIT",
    "GLOBAL_BATCH",
    "GPUS",
    "INTER_NODE_GBPS",
    "MARGIN",
    "MAX_PIPELINES",
    "MAX_TP",
    "MICROBATCHES",
    "MICRO_BATCH",
    "NODES",
    "PP",
    "Parser",
    "SEQ_LEN",
    "STAGES_PER_RANK",
    "TP",
    "add_gpu_args",
    "add_cache_arg",
    "add_host_arg",
    "add_step_args",
    "add_target_args",
    "add_workload_args",
    "build_workload",
    "check_args",
    "choose_precision",
    "csv_list",
    "lora_spec",
    "optimizer_name",
    "target_gpu",
    "technique_fields",
]

# What ``llmem`` exits with besides 0: bad input (one line on stderr naming the
# value and the fix), and a job that does not fit (the report is still printed).
EXIT_BAD_INPUT = 2
EXIT_WONT_FIT = 3

# Bounds of the numeric options, each with its reason. Tokens per micro-batch
# (seq_len x batch) stay at or below _MAX_TOKENS, beyond the longest context of
# any released model (Llama 4 Scout: 10M tokens), so that with the config
# bounds of models.config.check_config every traced tensor's byte size fits
# torch's int64 sizes (2**24 tokens x 2**24 vocabulary x 4 bytes = 2**50).
_MAX_TOKENS = 2**24
_MAX_BATCH = 2**16

# The estimate traces the first micro-steps and the last and extrapolates the
# steady state (estimate.py), so a long window costs no more; 65536 micro-steps
# per optimizer step (a global batch of 65536 sequences per GPU at micro-batch
# 1) is far beyond any fine-tuning recipe, and a larger value is a typo.
_MAX_GRAD_ACCUM = 2**16

# 65536 GPUs is four times the 16,384 H100s of Llama 3 405B's pre-training
# ("The Llama 3 Herd of Models", 2024, section 3.3); the ZeRO stages' emulation
# takes time linear in the data-parallel size, so a million GPUs would run for
# minutes.
_MAX_GPUS = 2**16

# A LoRA rank above the adapted layer's width adds nothing (the update is
# full-rank there); the widest catalog layer (llama-3.1-405b's MLP) is 53248.
_MAX_LORA_RANK = 2**16

# Tensor-parallel degrees stay inside one node (methods/layout.py); 72 is the
# largest NVLink domain sold (GB200 NVL72).
MAX_TP = 72
_MAX_GPUS_PER_NODE = 72


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line ending with a HINT."""

    # flag -> "FILE: KEY" for the options a --config file set, named when argparse refuses one of them
    origins: dict[str, str] = {}

    def error(self, message: str):  # noqa: D102 - argparse's hook
        flag = next((f for f in self.origins if f"argument {f}" in message), None)
        if flag is not None:
            message = f"{message} (set by {self.origins[flag]})"
        if "HINT" not in message:
            message = f"{message}. HINT: run '{self.prog} --help' for the options"
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _int_arg(flag: str, low: int, high: int, why: str):
    """An argparse type: an integer in [low, high]; ``why`` says where the bound comes from."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer. HINT: pass {flag} N with {low} <= N <= {high}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{value} is outside [{low}, {high}] ({why}). HINT: pass {flag} N with {low} <= N <= {high}")
        return value

    return parse


def _float_arg(flag: str, low: float, high: float, *, low_open: bool = False, high_open: bool = False,
                example: str = "1"):
    """An argparse type: a finite float in the given interval (NaN and infinities refused)."""
    lb, hb = "(" if low_open else "[", ")" if high_open else "]"
    interval = f"{lb}{low:g}, {high:g}{hb}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number. HINT: e.g. {flag} {example}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"{text} is outside {interval}. HINT: pass {flag} with a value in {interval}, e.g. {example}")
        return value

    return parse


# The integer options' types (argparse ``type=``), each bound with its reason.
SEQ_LEN = _int_arg("--seq-len", 1, _MAX_TOKENS, "tokens per sequence; longer than any model's context")
_BATCH = _int_arg("--batch-size", 1, _MAX_BATCH, "sequences per micro-batch")
MICRO_BATCH = _int_arg("--micro-batch", 1, _MAX_BATCH, "sequences per micro-batch")
GLOBAL_BATCH = _int_arg("--global-batch", 1, _MAX_BATCH * _MAX_GRAD_ACCUM, "micro-batch bound x accumulation bound")
_GRAD_ACCUM = _int_arg("--grad-accum", 1, _MAX_GRAD_ACCUM, "beyond any fine-tuning recipe")
GPUS = _int_arg("--gpus", 1, _MAX_GPUS, "four times the largest published training job")
NODES = _int_arg("--nodes", 1, _MAX_GPUS, "at most one node per GPU")
TP = _int_arg("--tp", 1, MAX_TP, "a tensor-parallel group stays inside one node")

# A schedule step's microbatches: as many as the accumulation bound (one-row microbatches of a share that
# large). A rank the estimate cannot compose from short runs (the last rank under return_outputs) is traced
# microbatch by microbatch, which methods/pp.py refuses above step.MAX_TRACED_MICRO_STEPS with its own hint.
MICROBATCHES = _int_arg("--microbatches", 1, _MAX_GRAD_ACCUM, "beyond any fine-tuning recipe's batch")
PP = _int_arg("--pp", 2, _MAX_GPUS, "a pipeline of at least two ranks, at most one per GPU")
MAX_PIPELINES = _int_arg("--max-pipelines", 0, 1024, "0 traces none, --no-prune all")
STAGES_PER_RANK = _int_arg("--stages-per-rank", 1, 16, "torchtitan's interleaved schedules use 2 to 4")
_LORA_RANK = _int_arg("--lora-rank", 1, _MAX_LORA_RANK, "a rank above the layer width adds nothing")
_LOSS_CHUNKS = _int_arg("--loss-chunks", 1, _MAX_TOKENS, "at most one chunk per token")
_LOGITS_TO_KEEP = _int_arg("--logits-to-keep", 0, _MAX_TOKENS, "at most every token; 0 keeps all")
_TARGET_LEN = _int_arg("--target-len", 1, _MAX_TOKENS, "target tokens per sequence; longer than any model's context")
_CHECKPOINT_EVERY = _int_arg("--checkpoint-every", 1, 1024, "more than any model's layers")
_IMAGES = _int_arg("--images", 1, 64, "images per sample; beyond any vision-language recipe")
_STEPS = _int_arg("--steps", 1, 5000, "steps replayed; llmem_plugin.techniques.varlen.MAX_STEPS")
_PACKED_DOCS = _int_arg("--packed-docs", 1, _MAX_TOKENS, "documents per packed micro-batch, at most one per token")

# The float options' intervals: --lora-alpha (0, 1e6] (peft scales the
# update by alpha / rank; recipes use 1 to 4 x rank, so 1e6 only stops typos);
# --lora-dropout [0, 1) (torch.nn.Dropout's p; 1 would drop every input);
# --margin [0, 1) (a fraction of GPU memory kept free); --efficiency (0, 1]
# (model FLOPs utilisation); --inter-node-gbps (0, 1e4] (GB/s per GPU: 100 x
# an 800 Gb/s NIC).
_LORA_ALPHA = _float_arg("--lora-alpha", 0, 1e6, low_open=True, example="32")
_LORA_DROPOUT = _float_arg("--lora-dropout", 0, 1, high_open=True, example="0.05")
MARGIN = _float_arg("--margin", 0, 1, high_open=True, example="0.05")
EFFICIENCY = _float_arg("--efficiency", 0, 1, low_open=True, example="0.4")
INTER_NODE_GBPS = _float_arg("--inter-node-gbps", 0, 1e4, low_open=True, example="50")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The job ``llmem estimate`` traces: model and batch, checkpointing, then the step settings."""
    g = p.add_argument_group("model and batch")
    g.add_argument("--model", required=True,
                   help="catalog name, config.json path, or cached Hub id; litgpt:NAME or litgpt:DIR for litgpt's "
                        "own model class and finetune loop (one GPU; docs/models.md)")
    g.add_argument("--seq-len", type=SEQ_LEN, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--seq-lens", default=None, metavar="LENGTHS",
                   help="variable-length batches: sample lengths as a file (one per line, a JSON list, or JSONL "
                        "with 'length' or 'input_ids'), MIN:MAX, MIN:MAX:MEAN or LEN:COUNT,...; each micro-batch "
                        "is padded to its longest sample (up to --seq-len) and a run of steps is replayed through "
                        "the allocator (docs/techniques/variable-length.md)")
    g.add_argument("--packed-docs", type=_PACKED_DOCS, default=None, metavar="N",
                   help="padding-free packing: each micro-batch's --batch-size x --seq-len tokens in one row of N "
                        "documents, their boundaries passed to flash attention's varlen kernel (TRL's padding-free "
                        "collator; needs --attn flash_attention_2; docs/techniques/packing.md)")
    g.add_argument("--packed-boundaries", default="collator", choices=("collator", "positions"),
                   help="with --packed-docs, how the model gets the documents' boundaries: collator (among the "
                        "inputs, TRL's padding-free collator; the default) or positions (found from the position "
                        "ids in every attention call, after transformers' DataCollatorWithFlattening)")
    g.add_argument("--steps", type=_STEPS, default=None,
                   help="with --seq-lens, optimizer steps to replay (default: until reserved memory settles)")
    g.add_argument("--load", default="direct",
                   choices=("direct", "fp32-cast", "torchtune-0.1", "device-quantize"),
                   help="how the weights reach the GPU before step 1: direct (each tensor once in its training "
                        "dtype, the default; with --quantize nf4-torchao, as torchtune 0.6.1 builds and loads it), "
                        "fp32-cast (materialised in fp32, then cast one by one), torchtune-0.1 (torchtune 0.1's "
                        "QLoRA setup with torchao 0.1) or device-quantize (with --quantize nf4/fp4: the whole "
                        "model on the GPU in 16 bits, then quantized layer by layer); the report gives the setup "
                        "phase beside the step")
    g.add_argument("--task", default=None,
                   help="what the model is trained for: causal-lm, seq-cls, token-cls, seq2seq, "
                        "image-text-to-text, masked-lm (default: the class the config's architectures names; "
                        "docs/models.md)")
    g.add_argument("--images", type=_IMAGES, default=None,
                   help="images per sample of a vision-language model (default 1)")
    g.add_argument("--freeze-vision", action="store_true",
                   help="keep a vision-language model's vision tower frozen")
    g.add_argument("--target-len", type=_TARGET_LEN, default=None,
                   help="target tokens per sequence of a seq2seq model (default: --seq-len)")
    g.add_argument("--batch-size", type=_BATCH, default=1, help="micro-batch size per GPU (default 1)")
    g.add_argument("--grad-accum", type=_GRAD_ACCUM, default=1, help="gradient accumulation steps (default 1)")
    g.add_argument("--runner", default=None, metavar="{torch,hf-trainer,lightning,plain-loop}",
                   help="the training loop: torch (each step's outputs freed after backward; default; plain-loop for a "
                        "litgpt:NAME model), hf-trainer "
                        "(adds accelerate's fp32 outputs and gradient clipping), lightning (zero_grad between "
                        "forward and backward), plain-loop (a hand-written loop that keeps the last step's "
                        "outputs and loss until the next forward returns: litgpt, peft's benchmark)")
    g = p.add_argument_group("activation checkpointing", "what the backward recomputes instead of keeping")
    g.add_argument("--grad-checkpointing", action="store_true", help="non-reentrant gradient checkpointing")
    g.add_argument("--checkpoint-reentrant", action="store_true",
                   help="with --grad-checkpointing, torch's reentrant checkpointing (use_reentrant=True; "
                        "LLaMA-Factory's default)")
    g.add_argument("--checkpoint-every", type=_CHECKPOINT_EVERY, default=1,
                   help="with --grad-checkpointing, checkpoint every K-th layer only (torchtitan's layer-level "
                        "selective AC; default 1: every layer)")
    g.add_argument("--checkpoint-save-ops", default=None, metavar="POLICY",
                   help="with --grad-checkpointing, op-level selective AC: checkpointed layers keep these ops' "
                        "outputs and recompute the rest; 'torchtitan' (its selective op policy: matmuls except "
                        "every second one, attention kernels) or comma-separated ops, e.g. aten.mm")
    add_step_args(p)


def add_step_args(p: argparse.ArgumentParser) -> None:
    """Workload settings the planner keeps as the user set them, in groups."""
    _add_numerics_args(p)
    _add_qlora_args(p)
    _add_loss_args(p)
    _add_activations_and_lora_args(p)


def _add_numerics_args(p: argparse.ArgumentParser) -> None:
    """The precision, the optimizer and the attention implementation."""
    g = p.add_argument_group("numerics and optimizer")
    g.add_argument("--precision", default=None,
                   help="fp32, bf16-mixed, fp16-mixed or bf16 (default: bf16-mixed; bf16 for MoE models whose "
                        "experts run grouped_mm, which takes bf16 weights only; the choice is printed)")
    g.add_argument("--optimizer", default=None,
                   help="adamw (foreach, default), adamw-fused, adamw-forloop, sgd, adafactor, and bitsandbytes' "
                        "adamw8bit, paged-adamw or paged-adamw8bit (the default for a quantized litgpt:NAME model, "
                        "whose instantiate_bnb_optimizer makes it)")
    g.add_argument("--attn", default="auto",
                   help="attention implementation: auto (transformers' default: sdpa where supported), sdpa, eager "
                        "or flash_attention_2")


def _add_qlora_args(p: argparse.ArgumentParser) -> None:
    """QLoRA: the quantized base weights and how the recipe prepares them."""
    g = p.add_argument_group("QLoRA", "quantized frozen base weights (bitsandbytes) and how the recipe prepares them; "
                             "the report states the preparation assumed")
    g.add_argument("--quantize", default=None, metavar="{nf4,fp4,int8,nf4-torchao}",
                   help="quantized weights for the frozen base model (QLoRA; needs --lora-rank): bitsandbytes' "
                        "nf4/fp4/int8, or nf4-torchao (torchao's NF4, as torchtune's QLoRA runs it)")
    g.add_argument("--double-quant", action="store_true", help="quantize the 4-bit statistics too (nf4/fp4)")
    g.add_argument("--kbit-prepare", default=None, metavar="{on,off,norms-only}",
                   help="with --quantize, whether peft's prepare_model_for_kbit_training runs: on (every 16-bit "
                        "parameter to fp32, the default for bitsandbytes), off (the recipe skips it and keeps "
                        "them 16-bit; torchtune's), norms-only (only the norm weights to fp32)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the output head too (Lightning's BitsandbytesPrecision, as litgpt uses it; "
                        "transformers with llm_int8_skip_modules=[]); needs an untied head")
    g.add_argument("--quantized-from", default=None, metavar="{fp16,bf16,fp32}",
                   help="dtype of the weights bitsandbytes quantized (QuantState.dtype, what each dequantization "
                        "returns before the cast to the compute dtype; default: the compute dtype, as transformers' "
                        "recipe loads in it; Lightning's BitsandbytesPrecision quantizes from fp16)")
    g.add_argument("--bnb-version", default=None, metavar="X.Y.Z",
                   help="bitsandbytes release the job runs (default: 0.50.2, the newest read; 0.42.0, litgpt "
                        "0.4.13's pin, for a litgpt:NAME model; the report names it); before 0.43.2 each 4-bit "
                        "matmul keeps its input until the loss is freed, before 0.50.0 every training matmul "
                        "dequantizes its weight")


def _add_loss_args(p: argparse.ArgumentParser) -> None:
    """How the logits and the cross-entropy are computed."""
    g = p.add_argument_group("loss path", "how the logits and the cross-entropy are computed; the report names the "
                                          "path assumed (docs/techniques/loss.md)")
    g.add_argument("--loss", default="hf", metavar="{hf,no-upcast,liger,chunked,cce,trl-fused}",
                   help="loss: hf (the model's own, logits upcast to fp32; default), no-upcast (cross-entropy on "
                        "the logits' own dtype, e.g. bf16), liger (fused linear cross-entropy), chunked "
                        "(torchtune's chunked-output cross-entropy), cce (Cut Cross-Entropy, no logits) or "
                        "trl-fused (TRL 1.16's fused LM head, as its SFTTrainer runs it)")
    g.add_argument("--loss-chunks", type=_LOSS_CHUNKS, default=None, help="chunks for --loss chunked (default 8)")
    g.add_argument("--loss-chunk-upcast", default="on", choices=("on", "off"),
                   help="with --loss chunked: upcast each chunk's logits to fp32 (on, torchtune) or not (off)")
    g.add_argument("--outputs-to-fp32", action="store_true",
                   help="the loop's model wrapper returns the model's outputs cast to fp32 and the loop's loss runs "
                        "on them, as Lightning Fabric does under bf16-true/16-true/bitsandbytes precision "
                        "(litgpt's finetune scripts)")
    g.add_argument("--logits-to-keep", type=_LOGITS_TO_KEEP, default=0,
                   help="compute logits and loss for only the last N tokens (default 0: all)")


def _add_activations_and_lora_args(p: argparse.ArgumentParser) -> None:
    """Activation offload, a reference model, and LoRA."""
    g = p.add_argument_group("activations and reference model")
    g.add_argument("--offload-activations", nargs="?", const="streamed", default=None,
                   metavar="{streamed,save-on-cpu}",
                   help="offload saved activations to pinned host memory: streamed (TRL/torchtune "
                        "OffloadActivations, the default when given bare) or save-on-cpu (torch.autograd.graph)")
    g.add_argument("--reference-model", action="store_true",
                   help="also run a frozen reference model's forward each step, as DPO does (with --loss "
                        "trl-fused: TRL DPOTrainer's step; --batch-size counts chosen and rejected rows)")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-rank", type=_LORA_RANK, default=None, help="enable LoRA with this rank")
    g.add_argument("--lora-alpha", type=_LORA_ALPHA, default=None, help="LoRA alpha (default 2 x rank)")
    g.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default q_proj,k_proj,v_proj,o_proj), or all-linear")
    g.add_argument("--lora-dropout", type=_LORA_DROPOUT,
                   default=None, help="LoRA dropout (default 0)")
    g.add_argument("--lora-adapter-dtype", choices=("fp32", "base"), default=None,
                   help="dtype of the LoRA adapters of a 16-bit model: fp32 (peft's default, "
                        "autocast_adapter_dtype=True: each adapter runs on an fp32 copy of its input) or base "
                        "(the base weights' dtype: peft with autocast_adapter_dtype=False, litgpt, torchtune; the "
                        "default with --quantize nf4-torchao and with a litgpt:NAME model)")


def add_gpu_args(p: argparse.ArgumentParser) -> None:
    """``--gpu`` and ``--gpu-memory``, in their own group."""
    p = p.add_argument_group("GPU and environment")
    p.add_argument("--gpu", default=None, help="GPU from `llmem gpus` (default h100-sxm)")
    p.add_argument("--gpu-memory", default=None,
                   help="override the GPU's capacity, e.g. 80GiB, 40GB, 81920MiB, or a number of GiB")


def add_host_arg(p: argparse.ArgumentParser) -> None:
    """``--host-memory``: the node's RAM the host side is checked against."""
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host (CPU) RAM per node, e.g. 2TiB, 768GiB or 1152GB, or 'local' for this machine's "
                        "(default: the catalog's cloud instance with these GPUs, printed with the report)")


def add_cache_arg(p: argparse.ArgumentParser) -> None:
    """``--no-cache``: trace anew, without reading or writing the trace cache."""
    p.add_argument("--no-cache", action="store_true",
                   help="trace anew: neither read nor write the trace cache (kept in $LLMEM_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/llmem or ~/.cache/llmem; LLMEM_NO_CACHE=1 turns it off too)")


def add_target_args(p: argparse.ArgumentParser) -> None:
    """The GPU, the allocator configuration and the torch version the job runs on."""
    add_gpu_args(p)
    p = p.add_argument_group("allocator and torch version")
    p.add_argument("--alloc-conf", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    p.add_argument("--torch-version", default=None,
                   help="torch version the job runs, for version-dependent overheads (default: installed)")


def target_gpu(args: argparse.Namespace):
    """The :class:`~llmem_plugin.device.gpus.GPU` that ``--gpu`` and ``--gpu-memory`` name."""
    from llmem_plugin.device.gpus import resolve_gpu

    return resolve_gpu(args.gpu, args.gpu_memory)


def _default_adapter_dtype(args: argparse.Namespace) -> str:
    """peft's fp32 adapters, except under torchtune's QLoRA (``--quantize nf4-torchao``), whose
    LoRALinear is built in the model's dtype (recipes' ``set_default_dtype`` around instantiate)."""
    if getattr(args, "quantize", None) == "nf4-torchao" or _litgpt_job(args):
        return "base"  # litgpt too: it creates its adapters inside fabric.init_module()
    return "fp32"


def lora_spec(args: argparse.Namespace):
    """The LoRA options as a :class:`~llmem_plugin.workload.LoraSpec` (None without ``--lora-rank``).

    Raises:
        ConfigError: LoRA options without ``--lora-rank``, or malformed ``--lora-targets``.
    """
    from llmem_plugin.workload import LoraSpec

    lora = None
    if args.lora_rank is not None:
        kw = {"rank": args.lora_rank, "alpha": args.lora_alpha,
              "dropout": 0.0 if args.lora_dropout is None else args.lora_dropout,
              "adapter_dtype": args.lora_adapter_dtype or _default_adapter_dtype(args)}
        if args.lora_targets is not None:
            targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
            if not targets or any(not t.replace("_", "").replace(".", "").replace("-", "").isalnum()
                                  for t in targets):
                from llmem_plugin.errors import ConfigError

                raise ConfigError(f"--lora-targets {args.lora_targets!r} is not a comma-separated list of module "
                                  "names. HINT: e.g. --lora-targets q_proj,v_proj, or all-linear")
            kw["target_modules"] = targets
        lora = LoraSpec(**kw)
    else:
        given = [flag for flag, value in (("--lora-targets", args.lora_targets), ("--lora-alpha", args.lora_alpha),
                                          ("--lora-dropout", args.lora_dropout),
                                          ("--lora-adapter-dtype", args.lora_adapter_dtype))
                 if value is not None]
        if given:
            from llmem_plugin.errors import ConfigError

            raise ConfigError(f"{'/'.join(given)} set LoRA options, but LoRA is off. HINT: add --lora-rank 16")
    return lora


def _litgpt_job(args: argparse.Namespace) -> bool:
    """Whether ``--model`` names a litgpt model (``litgpt:NAME``/``litgpt:DIR``)."""
    from llmem_plugin.models.config import is_litgpt_source

    return is_litgpt_source(getattr(args, "model", None))


def optimizer_name(args: argparse.Namespace) -> str:
    """``--optimizer``, or its default: adamw; bitsandbytes' PagedAdamW for a quantized litgpt job
    (litgpt/utils.py ``instantiate_bnb_optimizer`` replaces the configured AdamW with it)."""
    if args.optimizer is not None:
        return args.optimizer
    return "paged-adamw" if _litgpt_job(args) and args.quantize is not None else "adamw"


def _runner(args: argparse.Namespace) -> str:
    """``--runner``, or its default: torch; litgpt's fit() loop (plain-loop) for a litgpt job."""
    runner = getattr(args, "runner", None)
    if runner is not None:
        return runner
    return "plain-loop" if _litgpt_job(args) else "torch"


def build_workload(args: argparse.Namespace):
    """The :class:`~llmem_plugin.workload.Workload` ``llmem estimate``'s options describe."""
    from llmem_plugin.workload import Workload

    lora = lora_spec(args)
    return Workload(
        seq_len=args.seq_len,
        micro_batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum,
        precision=args.precision,
        optimizer=optimizer_name(args),
        grad_checkpointing=args.grad_checkpointing,
        lora=lora,
        attn_implementation=args.attn,
        runner=_runner(args),
        **technique_fields(args),
    )


def technique_fields(args: argparse.Namespace) -> dict:
    """The low-memory technique settings (``add_step_args``) as Workload fields."""
    if args.bnb_version is not None and args.quantize is None:
        from llmem_plugin.errors import ConfigError

        raise ConfigError("--bnb-version applies to quantized base weights. HINT: add --quantize nf4 (QLoRA), "
                          "or drop --bnb-version")
    # litgpt quantizes through Lightning's BitsandbytesPrecision: every nn.Linear, the head included,
    # from fp16, and no k-bit preparation (llmem_plugin.models.litgpt); those are its defaults here.
    lightning_bnb = args.quantize in ("nf4", "fp4") and _litgpt_job(args)
    return {
        "quantize": args.quantize,
        "double_quant": args.double_quant,
        "kbit_prepare": args.kbit_prepare or ("off" if lightning_bnb else None),
        "quantize_lm_head": args.quantize_lm_head or lightning_bnb,
        # litgpt 0.4.13 pins bitsandbytes 0.42.0 (its "all" extra)
        "bnb_version": args.bnb_version or ("0.42.0" if lightning_bnb else None),
        "quantized_from": args.quantized_from or ("fp16" if lightning_bnb else None),
        "loss": args.loss,
        "loss_chunks": 8 if args.loss_chunks is None else args.loss_chunks,
        "loss_chunk_upcast": getattr(args, "loss_chunk_upcast", "on") == "on",
        "outputs_to_fp32": getattr(args, "outputs_to_fp32", False),
        "logits_to_keep": args.logits_to_keep,
        "offload_activations": args.offload_activations,
        "reference_model": args.reference_model,
        "target_len": getattr(args, "target_len", None),
        "task": getattr(args, "task", None),
        "checkpoint_every": getattr(args, "checkpoint_every", 1),
        "checkpoint_reentrant": getattr(args, "checkpoint_reentrant", False),
        "checkpoint_save_ops": getattr(args, "checkpoint_save_ops", None),
        "load": getattr(args, "load", "direct"),
        "images": getattr(args, "images", None),
        "freeze_vision": getattr(args, "freeze_vision", False),
        "packed_docs": getattr(args, "packed_docs", None),
        "packed_boundaries": getattr(args, "packed_boundaries", "collator"),
    }


def choose_precision(args: argparse.Namespace) -> None:
    """Fill a ``--precision`` left out with the model's default, and say so when it is not bf16-mixed."""
    if args.precision is not None:
        return
    from llmem_plugin.models.modelbuild import default_precision

    args.precision, why = default_precision(args.model)
    if why:
        print(f"llmem: precision {args.precision} (the default for this model: {why}); pass --precision to "
              "choose another", file=sys.stderr)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad or contradictory options before anything is built or traced.

    Raises:
        ConfigError: The first bad option, named, with its fix.
    """
    from llmem_plugin.errors import ConfigError

    if getattr(args, "loss_chunks", None) is not None and args.loss != "chunked":
        raise ConfigError(f"--loss-chunks {args.loss_chunks} applies to --loss chunked only, not --loss {args.loss}. "
                          "HINT: add --loss chunked, or drop --loss-chunks")
    if getattr(args, "torch_version", None) is not None:
        _check_torch_version(args.torch_version)
    if getattr(args, "gpu", None) is not None:
        from llmem_plugin.device.gpus import get_gpu

        get_gpu(args.gpu)
    if getattr(args, "gpu_memory", None) is not None:
        _check_gpu_memory(args.gpu_memory)
    if args.command == "plan":
        csv_list(args.methods)
        csv_list(args.tp, TP)
    if getattr(args, "plot", None):
        _check_output_path(args.plot, "--plot", suffixes=(".png", ".svg", ".pdf"))
    if getattr(args, "snapshot", None):  # a pickle, as _dump_snapshot writes, or JSON (snapshot.predict)
        _check_output_path(args.snapshot, "--snapshot", suffixes=(".pickle", ".pkl", ".json"))
    if getattr(args, "html", None):
        _check_output_path(args.html, "--html", suffixes=(".html", ".htm"))
    gpus, nodes = getattr(args, "gpus", None), getattr(args, "nodes", 1)
    if gpus is not None and gpus > _MAX_GPUS_PER_NODE * nodes:
        raise ConfigError(f"--gpus {gpus} over --nodes {nodes} puts {-(-gpus // nodes)} GPUs on a node; a node holds "
                          f"at most {_MAX_GPUS_PER_NODE} (the largest NVLink domain). HINT: pass --nodes "
                          f"{-(-gpus // _MAX_GPUS_PER_NODE)} or more")
    if hasattr(args, "lora_rank"):
        lora_spec(args)  # LoRA options without LoRA, malformed targets
    seq_len = getattr(args, "seq_len", None)
    tokens = seq_len * max(getattr(args, "batch_size", 1) or 1, getattr(args, "micro_batch", None) or 1) \
        if seq_len else 0
    if tokens > _MAX_TOKENS:
        raise ConfigError(f"--seq-len {seq_len} x micro-batch is {tokens:,} tokens per micro-batch, above the "
                          f"{_MAX_TOKENS:,} modelled (beyond any model's context). HINT: lower --batch-size or --seq-len")


# --gpu-memory bounds: 1 MiB holds not even one cuBLAS workspace (8 MiB,
# overheads.py); 16 TiB is far above the largest GPU (B300: 288 GB).
_GPU_MEMORY_BOUNDS = (2**20, 2**44)


def _check_gpu_memory(text: str) -> None:
    """Refuse a ``--gpu-memory`` that does not parse or lies outside ``_GPU_MEMORY_BOUNDS``."""
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.device.gpus import parse_memory

    try:
        nbytes = parse_memory(text)
    except ConfigError as e:
        raise ConfigError(f"--gpu-memory: {e}") from None
    low, high = _GPU_MEMORY_BOUNDS
    if not low <= nbytes <= high:
        raise ConfigError(f"--gpu-memory {text!r} is {nbytes:,} bytes, outside 1 MiB to 16 TiB (a GPU's memory). "
                          "HINT: e.g. --gpu-memory 80GiB")


def _check_torch_version(text: str) -> None:
    """Refuse a ``--torch-version`` the overheads do not know."""
    from llmem_plugin.device.versions import check_torch_version

    check_torch_version(text)


def _check_output_path(path: str, flag: str, *, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file that cannot be written, before the work that fills it."""
    import os

    from llmem_plugin.errors import ConfigError

    if "\0" in path:
        raise ConfigError(f"{flag} {path!r} holds a NUL byte. HINT: pass a file name such as memory.png")
    if not path.lower().endswith(suffixes):
        raise ConfigError(f"{flag} {path!r} has no known suffix for it. HINT: end it with {', '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path!r}: folder {folder} does not exist. HINT: create it, or write elsewhere")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path!r} cannot be written. HINT: pass a writable file path")


def csv_list(value: str | None, cast=str) -> list | None:
    """A comma-separated option as a list of ``cast`` values (None when not given).

    Raises:
        ConfigError: An item ``cast`` refuses, or an empty list.
    """
    from llmem_plugin.errors import ConfigError

    if value is None:
        return None
    try:
        items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"cannot read '{value}' as a comma-separated list: {e}") from None
    except ValueError:
        raise ConfigError(f"cannot read '{value}' as a comma-separated list. HINT: e.g. 2,4,8") from None
    if not items:
        raise ConfigError(f"empty list '{value}'. HINT: e.g. fsdp,zero3")
    return items
