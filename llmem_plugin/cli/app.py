"""The ``llmem`` command line.

Each command is a parser function plus a command function. Exit codes: 0 on
success, 2 for bad input (one line on stderr, no traceback), 3 when nothing
fits (``llmem plan``: the report is still printed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

__all__ = ["EXIT_BAD_INPUT", "EXIT_WONT_FIT", "main"]

EXIT_BAD_INPUT = 2
EXIT_WONT_FIT = 3

# Bounds of the numeric options, each with its reason. Tokens per micro-batch
# (seq_len x batch) stay at or below _MAX_TOKENS, beyond the longest context of
# any released model (Llama 4 Scout: 10M tokens), so that with the config
# bounds of modelbuild.check_config every traced tensor's byte size fits
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
_MAX_TP = 72
_MAX_GPUS_PER_NODE = 72


class _Parser(argparse.ArgumentParser):
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


# The float options' intervals: --lora-alpha (0, 1e6] (peft scales the
# update by alpha / rank; recipes use 1 to 4 x rank, so 1e6 only stops typos);
# --lora-dropout [0, 1) (torch.nn.Dropout's p; 1 would drop every input);
# --margin [0, 1) (a fraction of GPU memory kept free); --efficiency (0, 1]
# (model FLOPs utilisation); --inter-node-gbps (0, 1e4] (GB/s per GPU: 100 x
# an 800 Gb/s NIC).
_SEQ_LEN = _int_arg("--seq-len", 1, _MAX_TOKENS, "tokens per sequence; longer than any model's context")
_BATCH = _int_arg("--batch-size", 1, _MAX_BATCH, "sequences per micro-batch")
_MICRO_BATCH = _int_arg("--micro-batch", 1, _MAX_BATCH, "sequences per micro-batch")
_GLOBAL_BATCH = _int_arg("--global-batch", 1, _MAX_BATCH * _MAX_GRAD_ACCUM, "micro-batch bound x accumulation bound")
_GRAD_ACCUM = _int_arg("--grad-accum", 1, _MAX_GRAD_ACCUM, "beyond any fine-tuning recipe")
_GPUS = _int_arg("--gpus", 1, _MAX_GPUS, "four times the largest published training job")
_NODES = _int_arg("--nodes", 1, _MAX_GPUS, "at most one node per GPU")
_TP = _int_arg("--tp", 1, _MAX_TP, "a tensor-parallel group stays inside one node")
# A schedule step's microbatches: as many as the accumulation bound (one-row microbatches of a share that
# large). A rank the estimate cannot compose from short runs (the last rank under return_outputs) is traced
# microbatch by microbatch, which methods/pp.py refuses above step.MAX_TRACED_MICRO_STEPS with its own hint.
_MICROBATCHES = _int_arg("--microbatches", 1, _MAX_GRAD_ACCUM, "beyond any fine-tuning recipe's batch")
_PP = _int_arg("--pp", 2, _MAX_GPUS, "a pipeline of at least two ranks, at most one per GPU")
_MAX_PIPELINES = _int_arg("--max-pipelines", 0, 1024, "0 traces none, --no-prune all")
_STAGES_PER_RANK = _int_arg("--stages-per-rank", 1, 16, "torchtitan's interleaved schedules use 2 to 4")
_LORA_RANK = _int_arg("--lora-rank", 1, _MAX_LORA_RANK, "a rank above the layer width adds nothing")
_LOSS_CHUNKS = _int_arg("--loss-chunks", 1, _MAX_TOKENS, "at most one chunk per token")
_LOGITS_TO_KEEP = _int_arg("--logits-to-keep", 0, _MAX_TOKENS, "at most every token; 0 keeps all")
_TARGET_LEN = _int_arg("--target-len", 1, _MAX_TOKENS, "target tokens per sequence; longer than any model's context")
_CHECKPOINT_EVERY = _int_arg("--checkpoint-every", 1, 1024, "more than any model's layers")
_IMAGES = _int_arg("--images", 1, 64, "images per sample; beyond any vision-language recipe")
_STEPS = _int_arg("--steps", 1, 5000, "steps replayed; llmem_plugin.techniques.varlen.MAX_STEPS")
_PACKED_DOCS = _int_arg("--packed-docs", 1, _MAX_TOKENS, "documents per packed micro-batch, at most one per token")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and batch")
    g.add_argument("--model", required=True,
                   help="catalog name, config.json path, or cached Hub id; litgpt:NAME or litgpt:DIR for litgpt's "
                        "own model class and finetune loop (one GPU; docs/models.md)")
    g.add_argument("--seq-len", type=_SEQ_LEN, default=2048, help="tokens per sequence (default 2048)")
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
    g.add_argument("--load", default="direct", choices=("direct", "fp32-cast"),
                   help="how the weights reach the GPU before step 1: direct (each tensor once in its training "
                        "dtype, the default) or fp32-cast (materialised in fp32, then cast one by one); the report "
                        "gives the setup phase beside the step")
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
    _add_step_args(p)


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """Workload settings the planner keeps as the user set them, in groups."""
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
    g.add_argument("--lora-alpha", type=_float_arg("--lora-alpha", 0, 1e6, low_open=True, example="32"), default=None, help="LoRA alpha (default 2 x rank)")
    g.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default q_proj,k_proj,v_proj,o_proj), or all-linear")
    g.add_argument("--lora-dropout", type=_float_arg("--lora-dropout", 0, 1, high_open=True, example="0.05"),
                   default=None, help="LoRA dropout (default 0)")
    g.add_argument("--lora-adapter-dtype", choices=("fp32", "base"), default=None,
                   help="dtype of the LoRA adapters of a 16-bit model: fp32 (peft's default, "
                        "autocast_adapter_dtype=True: each adapter runs on an fp32 copy of its input) or base "
                        "(the base weights' dtype: peft with autocast_adapter_dtype=False, litgpt, torchtune; the "
                        "default with --quantize nf4-torchao and with a litgpt:NAME model)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("config file", "read the job from the file its framework runs (docs/recipes.md); "
                             "options given here override the file's")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="an Axolotl, LLaMA-Factory, torchtune or TRL (SFTConfig/DPOConfig) YAML or JSON file; its "
                        "memory keys become the options below, the rest are listed")
    g.add_argument("--config-format", default=None,  # llmem_plugin.recipes.FORMATS (imported on use)
                   choices=("axolotl", "llamafactory", "torchtune", "trl", "trl-sft", "trl-dpo"),
                   help="the file's framework (default: told from its keys); trl-sft/trl-dpo: the trl command")
    g.add_argument("--model-config", default=None, metavar="PATH",
                   help="with --config, the config.json of the file's model, for a model the catalog lacks "
                        "(nothing is downloaded)")


def _add_gpu_args(p: argparse.ArgumentParser) -> None:
    p = p.add_argument_group("GPU and environment")
    p.add_argument("--gpu", default=None, help="GPU from `llmem gpus` (default h100-sxm)")
    p.add_argument("--gpu-memory", default=None,
                   help="override the GPU's capacity, e.g. 80GiB, 40GB, 81920MiB, or a number of GiB")


def _add_host_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host (CPU) RAM per node, e.g. 2TiB, 768GiB or 1152GB, or 'local' for this machine's "
                        "(default: the catalog's cloud instance with these GPUs, printed with the report)")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    _add_gpu_args(p)
    p = p.add_argument_group("allocator and torch version")
    p.add_argument("--alloc-conf", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    p.add_argument("--torch-version", default=None,
                   help="torch version the job runs, for version-dependent overheads (default: installed)")


def _gpu(args: argparse.Namespace):
    from llmem_plugin.device.gpus import resolve_gpu

    return resolve_gpu(args.gpu, args.gpu_memory)


def _default_adapter_dtype(args: argparse.Namespace) -> str:
    """peft's fp32 adapters, except under torchtune's QLoRA (``--quantize nf4-torchao``), whose
    LoRALinear is built in the model's dtype (recipes' ``set_default_dtype`` around instantiate)."""
    if getattr(args, "quantize", None) == "nf4-torchao" or _litgpt_job(args):
        return "base"  # litgpt too: it creates its adapters inside fabric.init_module()
    return "fp32"


def _lora(args: argparse.Namespace):
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
    from llmem_plugin.models.litgpt import is_litgpt_source

    return is_litgpt_source(getattr(args, "model", None))


def _optimizer(args: argparse.Namespace) -> str:
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


def _workload(args: argparse.Namespace):
    from llmem_plugin.workload import Workload

    lora = _lora(args)
    return Workload(
        seq_len=args.seq_len,
        micro_batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum,
        precision=args.precision,
        optimizer=_optimizer(args),
        grad_checkpointing=args.grad_checkpointing,
        lora=lora,
        attn_implementation=args.attn,
        runner=_runner(args),
        **_technique_fields(args),
    )


def _technique_fields(args: argparse.Namespace) -> dict:
    """The low-memory technique settings (``_add_step_args``) as Workload fields."""
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


def _check_args(args: argparse.Namespace) -> None:
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
        _csv(args.methods)
        _csv(args.tp, _TP)
    if getattr(args, "plot", None):
        _check_output_path(args.plot, "--plot", suffixes=(".png", ".svg", ".pdf"))
    gpus, nodes = getattr(args, "gpus", None), getattr(args, "nodes", 1)
    if gpus is not None and gpus > _MAX_GPUS_PER_NODE * nodes:
        raise ConfigError(f"--gpus {gpus} over --nodes {nodes} puts {-(-gpus // nodes)} GPUs on a node; a node holds "
                          f"at most {_MAX_GPUS_PER_NODE} (the largest NVLink domain). HINT: pass --nodes "
                          f"{-(-gpus // _MAX_GPUS_PER_NODE)} or more")
    if hasattr(args, "lora_rank"):
        _lora(args)  # LoRA options without LoRA, malformed targets
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
    from llmem_plugin.device.versions import check_torch_version

    check_torch_version(text)


def _check_output_path(path: str, flag: str, *, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file that cannot be written, before the work that fills it."""
    import os

    from llmem_plugin.errors import ConfigError

    if "\0" in path:
        raise ConfigError(f"{flag} {path!r} holds a NUL byte. HINT: pass a file name such as memory.png")
    if not path.lower().endswith(suffixes):
        raise ConfigError(f"{flag} {path!r} has no known image suffix. HINT: end it with {', '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path!r}: folder {folder} does not exist. HINT: create it, or write elsewhere")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path!r} cannot be written. HINT: pass a writable file path")


def _choose_precision(args: argparse.Namespace) -> None:
    """Fill a ``--precision`` left out with the model's default, and say so when it is not bf16-mixed."""
    if args.precision is not None:
        return
    from llmem_plugin.models.modelbuild import default_precision

    args.precision, why = default_precision(args.model)
    if why:
        print(f"llmem: precision {args.precision} (the default for this model: {why}); pass --precision to "
              "choose another", file=sys.stderr)


def _parser_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="peak GPU memory of one fine-tuning step on one GPU")
    _add_config_args(p)
    _add_workload_args(p)
    _add_target_args(p)
    g = p.add_argument_group("distributed method")
    g.add_argument("--method", default=None,
                   help="distributed method (`--method help` lists them), or 'all' for every one that "
                        "applies (the default when --gpus/--tp/--nodes/--offload is given); default: one GPU")
    g.add_argument("--gpus", type=_GPUS, default=None, help="world size: GPUs over all nodes (default 1)")
    g.add_argument("--nodes", type=_NODES, default=1, help="nodes (default 1)")
    g.add_argument("--tp", type=_TP, default=None, help="tensor-parallel degree, inside a node (default 1)")
    g.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="CPU offload: optimizer states, or parameters too (ZeRO, FSDP)")
    g.add_argument("--deepspeed-config", default=None, metavar="JSON",
                   help="a DeepSpeed config (file or inline JSON): its zero_optimization stage and offload pick "
                        "the method (zero1/2/3, --offload) and its bucket sizes the buffers; HF's 'auto' values "
                        "are filled as the Trainer fills them")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallel for the tensor-parallel methods (tp, dp-tp, fsdp-tp)")
    g.add_argument("--pp", type=_PP, default=None,
                   help="pipeline methods (pp*): pipeline degree (default: --gpus); below --gpus, each stage is "
                        "FSDP2-sharded over the remaining ranks, as torchtitan composes them")
    g.add_argument("--microbatches", type=_MICROBATCHES, default=None,
                   help="pipeline methods (pp*): microbatches per step, each of --batch-size rows (default: "
                        "the pipeline degree)")
    g.add_argument("--stages-per-rank", type=_STAGES_PER_RANK, default=None,
                   help="pipeline methods: stages per rank (interleaved schedules; default 2, the V schedules 2)")
    g.add_argument("--no-return-outputs", dest="return_outputs", action="store_false", default=None,
                   help="pipeline methods: step the schedule with return_outputs=False, as torchtitan's trainer "
                        "does (the last stage keeps no microbatch's logits; torch's default keeps them all)")
    g.add_argument("--pp-split", default=None, metavar="SPLIT",
                   help="pipeline methods: decoder layers per stage, 'torchtitan' (default), 'colossalai', or "
                        "counts such as 8,9,8,7")
    g = p.add_argument_group("output")
    g.add_argument("--fast", action="store_true", help="trace a few layers and extrapolate to full depth")
    g.add_argument("--plot", default=None, metavar="FILE",
                   help="draw allocated and reserved memory over the traced step to FILE (png, svg, pdf)")
    g.add_argument("--json", action="store_true", help="print the estimate as JSON")
    _add_host_arg(p)
    p.set_defaults(func=_cmd_estimate)


def _cmd_methods(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import ConfigError, LLMemError
    from llmem_plugin.methods import Layout, estimate_method, method_names

    names = method_names()
    if args.method == "help":
        print("methods: " + ", ".join([*names, "all"]))
        return 0
    if args.method != "all" and args.method not in names:
        raise ConfigError(f"unknown method '{args.method}'; valid: {', '.join([*names, 'all'])}. "
                          "HINT: pass --method with one of them")
    num_gpus = 1 if args.gpus is None else args.gpus
    layout = Layout(num_gpus=num_gpus, num_nodes=args.nodes, tp=1 if args.tp is None else args.tp)
    options = {}
    if args.offload:
        options = {"offload_optimizer": True, "offload_param": args.offload == "params", "cpu_offload": True}
    if getattr(args, "deepspeed_config", None) is not None:
        options["config"] = args.deepspeed_config
    if args.sequence_parallel and args.method not in (*_TP_METHODS, "all"):
        raise ConfigError(f"--sequence-parallel needs a tensor-parallel method, not --method {args.method}. "
                          f"HINT: use one of {', '.join(_TP_METHODS)}")
    pipeline = {k: v for k, v in (("pipeline_degree", getattr(args, "pp", None)),
                                  ("microbatches", getattr(args, "microbatches", None)),
                                  ("stages_per_rank", getattr(args, "stages_per_rank", None)),
                                  ("split", _pp_split(getattr(args, "pp_split", None))),
                                  ("return_outputs", getattr(args, "return_outputs", None))) if v is not None}
    if pipeline and not args.method.startswith("pp"):
        flag = {"pipeline_degree": "--pp", "microbatches": "--microbatches", "stages_per_rank": "--stages-per-rank",
                "split": "--pp-split", "return_outputs": "--no-return-outputs"}
        raise ConfigError(f"{flag[next(iter(pipeline))]} applies to the pipeline methods, not --method "
                          f"{args.method}. HINT: use --method pp (or pp-gpipe, pp-interleaved, pp-zbv, pp-dualpipev, "
                          "pp-interleaved-zb)")
    if args.offload and args.method != "all" and args.method not in _OFFLOAD_METHODS:
        raise ConfigError(f"--offload is not modelled for --method {args.method}. HINT: use one of "
                          f"{', '.join(sorted(set(_OFFLOAD_METHODS) & set(names)))}")
    _choose_precision(args)
    gpu, wl = _gpu(args), _workload(args)
    if args.method != "single":
        from llmem_plugin.models.tasks import require_causal_lm

        # Said once for the command, not as every method's skip reason.
        require_causal_lm(args.model, f"--method {args.method}" if args.method != "all" else f"--gpus {num_gpus}",
                          wl.task)
    from llmem_plugin.device.host import resolve_host_memory

    host = resolve_host_memory(args.host_memory, gpu=gpu, gpus_per_node=layout.gpus_per_node)
    rows, skipped = [], []
    for name, lay in _method_layouts(args, names, layout):
        if args.offload and name not in _OFFLOAD_METHODS:
            skipped.append((name, "no CPU offload"))
            continue
        extra = {"sequence_parallel": True} if args.sequence_parallel and name in _TP_METHODS else {}
        if name.startswith("pp"):
            extra.update(pipeline)
            extra["fast"] = args.fast  # per-stage depth extrapolation (llmem_plugin.methods.pp.method)
        try:
            est = estimate_method(name, args.model, wl, layout=lay, gpu=gpu, alloc_conf=args.alloc_conf,
                                  torch_version=args.torch_version, **options, **extra)
        except LLMemError as e:
            if args.method != "all":
                raise
            skipped.append((name if lay.tp == 1 else f"{name} tp{lay.tp}", str(e).split(". HINT")[0]))
            continue
        rows.append(est)
    if getattr(args, "plot", None) and rows:
        _plot_ranks(rows[0], gpu, args.plot)
    if not rows:
        # On several GPUs, 'single' refuses for the GPU count alone: another method's reason says more.
        name, why = next((x for x in skipped if x[0] != "single" or num_gpus == 1), skipped[0])
        raise ConfigError(f"no method applies to {num_gpus} GPU(s): {name}: {why}. "
                          "HINT: see `llmem estimate --method help`, or change --gpus/--tp/--offload")
    if args.json:
        _emit_json(args, {"gpu": gpu.name, "capacity_bytes": gpu.capacity_bytes, "layout": layout.to_dict(),
                          "host_memory": host.to_dict(),
                          "methods": [r.to_dict() for r in rows],
                          "skipped": [{"method": n, "reason": why} for n, why in skipped]})
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_methods

        console = Console()
        _render_recipe(args, console)
        render_methods(rows, skipped, gpu, console, host=host)
    if not any(all(r.fits for r in est.ranks) for est in rows):
        what = f"--method {args.method} does not fit" if args.method != "all" else "no method fits"
        print(f"llmem: {what} {num_gpus} x {gpu.name} ({_size(gpu.capacity_bytes)} each); exit code "
              f"{EXIT_WONT_FIT}. HINT: `llmem plan` searches micro-batch, checkpointing and offload for a fit",
              file=sys.stderr)
        return EXIT_WONT_FIT
    on_gpu = [est for est in rows if all(r.fits for r in est.ranks)]  # not empty here
    if not any(est.host_total_bytes_per_node <= host.node_bytes for est in on_gpu):
        print(_host_misfit(min(est.host_total_bytes_per_node for est in on_gpu), host.node_bytes, host.source),
              file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _plot_ranks(est, gpu, path: str) -> None:
    """One bar per reported rank of one method's estimate (a pipeline's ranks differ), by segment."""
    from llmem_plugin.planner.search import rank_segments
    from llmem_plugin.cli.plot import plot_plan

    worst = max(range(len(est.ranks)), key=lambda i: est.ranks[i].device_total_bytes)
    plot_plan([(f"rank {r.rank}", rank_segments(r)) for r in est.ranks], capacity_bytes=gpu.capacity_bytes,
              margin=0.0, chosen=worst, path=path,
              title=f"{est.method} on {est.layout.num_gpus} x {gpu.name}: each rank's peak (framed: the worst)")


_TP_METHODS = ("tp", "dp-tp", "fsdp-tp")
# Methods whose layout has a tensor-parallel degree of 2 or more: with
# --method all and no --tp, each is tried at every degree that divides a node.
_TP_DEGREE_METHODS = (*_TP_METHODS, "hybrid")
# Methods that model CPU offload (ZeRO's offload_optimizer/offload_param, FSDP2's CPUOffloadPolicy).
_OFFLOAD_METHODS = ("fsdp", "hsdp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")


def _pp_split(text: str | None) -> str | list[int] | None:
    """``--pp-split``: a framework's name, or comma-separated layers per stage."""
    from llmem_plugin.errors import ConfigError

    if text is None or text in ("torchtitan", "colossalai"):
        return text
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-split {text!r} is not 'torchtitan', 'colossalai' or layers per stage. HINT: pass "
                          "e.g. --pp-split 8,9,8,7") from None
    return counts


def _method_layouts(args: argparse.Namespace, names: list[str], layout):
    """(method, layout) pairs to estimate: the user's --tp, or for 'all' without
    --tp every tensor-parallel degree > 1 that divides a node's GPUs for the TP methods."""
    import dataclasses

    if args.method != "all":
        return [(args.method, layout)]
    if args.tp is not None:
        return [(name, layout) for name in names]
    degrees = [d for d in range(2, min(layout.gpus_per_node, _MAX_TP) + 1) if layout.gpus_per_node % d == 0]
    pairs = []
    for name in names:
        if name.startswith("pp"):
            continue  # the pipeline methods trace many microbatches per rank: named with --method only
        if name in _TP_DEGREE_METHODS:
            pairs += [(name, dataclasses.replace(layout, tp=d)) for d in degrees]
            if not degrees:
                pairs.append((name, layout))  # refused with its reason (one GPU per node)
        else:
            pairs.append((name, layout))
    return pairs


def _cmd_estimate(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import ConfigError

    if args.deepspeed_config is not None:
        _deepspeed_args(args)
    if args.method is not None or args.gpus not in (None, 1) or args.tp not in (None, 1) or args.nodes != 1 \
            or args.offload:
        if args.plot and args.method in (None, "all"):
            raise ConfigError("--plot draws the single-GPU step, or each rank of one --method. HINT: name one "
                              "--method, drop --gpus/--tp/--nodes/--offload, or use `llmem plan --plot`")
        if args.method is None:  # a cluster without a method: compare them all
            args.method = "all"
        return _cmd_methods(args)
    if args.sequence_parallel:
        raise ConfigError("--sequence-parallel needs a tensor-parallel method. HINT: add --method tp --gpus 2 --tp 2, "
                          "or drop --sequence-parallel")
    from llmem_plugin.estimate import estimate

    _choose_precision(args)
    gpu, wl = _gpu(args), _workload(args)
    if args.steps is not None and args.seq_lens is None:
        raise ConfigError(f"--steps {args.steps} sets how many steps of varying length are replayed. HINT: add "
                          "--seq-lens (the sample lengths), or drop --steps")
    if args.seq_lens is not None:
        return _cmd_varlen(args, gpu, wl)
    est = estimate(args.model, wl, fast=args.fast, gpu=gpu, alloc_conf=args.alloc_conf,
                   torch_version=args.torch_version, host_memory=args.host_memory)
    if args.plot:
        from llmem_plugin.cli.plot import plot_estimate

        plot_estimate(est, args.plot)
    if args.json:
        _emit_json(args, est.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_estimate

        console = Console()
        _render_recipe(args, console)
        render_estimate(est, console)
    if not est.fits:
        print(f"llmem: the step does not fit the {gpu.name} ({_size(est.capacity_bytes)}); exit code "
              f"{EXIT_WONT_FIT}. HINT: `llmem plan` searches methods, micro-batch, checkpointing and offload for "
              "a fit", file=sys.stderr)
        return EXIT_WONT_FIT
    if not est.host_fits:
        print(_host_misfit(est.host_bytes, est.host_capacity_bytes, est.host_memory_source), file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _cmd_varlen(args: argparse.Namespace, gpu, wl) -> int:
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.techniques.varlen import estimate_variable_length

    if args.plot:
        raise ConfigError("--plot draws one fixed-shape step. HINT: drop --plot with --seq-lens")
    v = estimate_variable_length(args.model, wl, args.seq_lens, steps=args.steps, fast=args.fast, gpu=gpu,
                                 alloc_conf=args.alloc_conf, torch_version=args.torch_version)
    if args.json:
        _emit_json(args, v.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_varlen

        console = Console()
        _render_recipe(args, console)
        render_varlen(v, wl, gpu.name, console)
    if not v.fits:
        print(f"llmem: the run does not fit the {gpu.name} ({_size(v.capacity_bytes)}); exit code "
              f"{EXIT_WONT_FIT}. HINT: lower --batch-size or --seq-len (truncation), or add --grad-checkpointing",
              file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _deepspeed_args(args: argparse.Namespace) -> None:
    """``--deepspeed-config``: read it, and take its method and offload unless the flags name them."""
    from llmem_plugin.errors import ConfigError, LLMemError
    from llmem_plugin.methods.zero import deepspeed_method, read_deepspeed_config

    args.deepspeed_config = read_deepspeed_config(args.deepspeed_config)
    method, off_opt, off_par = deepspeed_method(args.deepspeed_config)
    from llmem_plugin.methods.zero import ZeroConfig

    try:  # its values, checked now (the method reads them again with the model's hidden size)
        ZeroConfig.from_deepspeed(args.deepspeed_config, stage=int(method[-1]), offload_optimizer=off_opt,
                                  offload_param=off_par, hidden_size=1)
    except (TypeError, ValueError) as e:
        if isinstance(e, LLMemError):
            raise
        raise ConfigError(f"--deepspeed-config: a zero_optimization value is not a number or switch "
                          f"({' '.join(str(e).split())[:120]}). HINT: check the file against DeepSpeed's config "
                          "docs") from None
    if args.method is None:
        args.method = method
    elif not args.method.startswith(method):
        raise ConfigError(f"--deepspeed-config is ZeRO {method[-1]}, --method is {args.method}. HINT: drop --method, "
                          "or pass a config of that stage")
    if args.offload is None and off_opt:
        args.offload = "params" if off_par else "optimizer"


def _host_misfit(need: int, capacity: int, source: str) -> str:
    return (f"llmem: host memory does not fit: {need / 2**30:.1f} GiB of host (CPU) RAM per node needed, "
            f"{capacity / 2**30:.1f} GiB there ({source}); exit code {EXIT_WONT_FIT}. HINT: give the node's RAM "
            "with --host-memory, spread the job over more nodes, or drop CPU offload")


def _parser_plan(sub) -> None:
    p = sub.add_parser("plan", help="pick the fastest fine-tuning method that fits the GPUs, or say why none does")
    _add_config_args(p)
    g = p.add_argument_group("model and batch")
    g.add_argument("--model", required=True, help="catalog name, config.json path, or cached Hub id")
    g.add_argument("--seq-len", type=_SEQ_LEN, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--global-batch", type=_GLOBAL_BATCH, default=None,
                   help="sequences per optimizer step over all GPUs (default 8 per GPU; with --config, the file's "
                        "micro-batch x accumulation per GPU)")
    g.add_argument("--runner", default="torch", choices=("torch", "hf-trainer", "lightning", "plain-loop"),
                   help="the training loop (as for estimate; default torch)")
    g = p.add_argument_group("cluster", "the GPUs the job gets")
    g.add_argument("--gpus", type=_GPUS, default=None, help="GPUs over all nodes (default: this machine's)")
    g.add_argument("--nodes", type=_NODES, default=1, help="nodes (default 1)")
    _add_host_arg(g)
    _add_gpu_args(p)
    g = p.add_argument_group("search", "what the planner tries; a pinned setting is not searched")
    g.add_argument("--margin", type=_float_arg("--margin", 0, 1, high_open=True, example="0.05"), default=None,
                   help="fraction of GPU memory kept free (default 0.05)")
    g.add_argument("--methods", default=None,
                   help="comma-separated methods to consider (default: all but pp-interleaved, searched only when "
                        "named)")
    g.add_argument("--tp", default=None, help="comma-separated tensor-parallel degrees (default: all that fit a node)")
    g.add_argument("--micro-batch", type=_MICRO_BATCH, default=None, help="pin the micro-batch (default: searched)")
    g.add_argument("--grad-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="search checkpointing (auto, default) or pin it")
    g.add_argument("--no-verify", action="store_true", help="skip the full trace of the choice (screen only)")
    g.add_argument("--no-prune", action="store_true",
                   help="screen every candidate, also those whose step-time bound cannot win (the full table)")
    g.add_argument("--max-pipelines", type=_MAX_PIPELINES, default=None,
                   help="pipeline configurations to trace at most, best step-time bounds first (default 1; each "
                        "costs minutes on a large model; --no-prune traces all)")
    _add_step_args(p)
    g = p.add_argument_group("allocator")
    g.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    g = p.add_argument_group("step-time model", "how candidates are ranked")
    g.add_argument("--efficiency", type=_float_arg("--efficiency", 0, 1, low_open=True, example="0.4"), default=None,
                   help="model FLOPs utilisation of the step-time model (default 0.40)")
    g.add_argument("--inter-node-gbps", type=_float_arg("--inter-node-gbps", 0, 1e4, low_open=True, example="50"),
                   default=None, help="network GB/s per GPU between nodes (default 50: 400 Gb/s InfiniBand)")
    g = p.add_argument_group("output")
    g.add_argument("--all", action="store_true", help="list every candidate")
    g.add_argument("--plot", default=None, metavar="FILE", help="draw the candidates' memory to FILE (png, svg, pdf)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)


def _plan_target(args: argparse.Namespace) -> tuple[str | None, int]:
    """(GPU name, GPU count): the flags', else this machine's."""
    from llmem_plugin.planner.search import gpus_on_this_machine

    if args.gpu is None and args.gpus is None:
        return gpus_on_this_machine()
    gpus = args.gpus if args.gpus is not None else 1
    return args.gpu, gpus


def _csv(value: str | None, cast=str) -> list | None:
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


def _cmd_plan(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import ConfigError, WontFitError
    from llmem_plugin.device.gpus import parse_memory
    from llmem_plugin.planner.search import DEFAULT_MARGIN, plan
    from llmem_plugin.workload import Workload

    gpu_memory = parse_memory(args.gpu_memory) if args.gpu_memory else None
    methods, tps = _csv(args.methods), _csv(args.tp, _TP)
    if args.reference_model and args.loss == "trl-fused":
        from llmem_plugin.errors import UnsupportedError
        from llmem_plugin.planner.search import DPO_NOT_SEARCHED

        raise UnsupportedError(DPO_NOT_SEARCHED)
    _choose_precision(args)
    wl = Workload(seq_len=args.seq_len, precision=args.precision, optimizer=_optimizer(args), lora=_lora(args),
                  attn_implementation=args.attn, runner=args.runner, **_technique_fields(args))
    gpu, n = _plan_target(args)
    if args.global_batch is None and args.recipe is not None:
        from llmem_plugin.recipes import global_batch

        args.global_batch = global_batch(args.recipe, n)
    if n % args.nodes:
        raise ConfigError(f"--nodes {args.nodes} must divide the {n} GPUs (every node holds as many). "
                          "HINT: pass a --gpus that is a multiple of --nodes")
    bad_tps = [t for t in tps or () if (n // args.nodes) % t]
    if bad_tps:
        raise ConfigError(f"--tp {','.join(map(str, bad_tps))} must divide the {n // args.nodes} GPUs of a node: a "
                          "tensor-parallel group stays inside one node. HINT: pass degrees that divide it")
    kw = {}
    if args.efficiency is not None:
        kw["efficiency"] = args.efficiency
    if args.max_pipelines is not None:
        kw["max_pipelines"] = args.max_pipelines
    if sys.stderr.isatty():  # a terminal sees what a long search is doing; pipes and logs keep one line
        kw["progress"] = lambda line: print(f"llmem: {line}", file=sys.stderr, flush=True)
    gc = {"auto": None, "on": True, "off": False}[args.grad_checkpointing]
    try:
        result, code = plan(
            args.model, gpu=gpu or "h100-sxm", num_gpus=n, num_nodes=args.nodes, workload=wl,
            global_batch=args.global_batch, margin=DEFAULT_MARGIN if args.margin is None else args.margin,
            methods=methods, tps=tps, micro_batch=args.micro_batch,
            grad_checkpointing=gc, gpu_memory=gpu_memory,
            alloc_conf=args.alloc_conf, inter_node_gbps=args.inter_node_gbps, verify=not args.no_verify,
            prune=not args.no_prune, host_memory=args.host_memory, **kw,
        ), 0
    except WontFitError as e:
        result, code = e.plan, EXIT_WONT_FIT
        if not args.json:
            print(f"llmem: {e}", file=sys.stderr)
    if args.plot:
        from llmem_plugin.cli.plot import plot_plan
        from llmem_plugin.cli.report import _plan_rows

        rows = _plan_rows(result, args.all)
        chosen = next((i for i, c in enumerate(rows) if c is result.choice), None)
        plot_plan([(c.label(), c.segments) for c in rows], capacity_bytes=result.capacity_bytes,
                  margin=result.margin, chosen=chosen, path=args.plot,
                  title=f"{result.model} on {result.layout.num_gpus} x {result.gpu.name}")
    if args.json:
        _emit_json(args, result.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_plan

        console = Console()
        _render_recipe(args, console)
        render_plan(result, Console(width=max(console.width, 130)), show_all=args.all)
    return code


def _parser_models(sub) -> None:
    p = sub.add_parser("models", help="list the bundled model catalog with exact parameter counts")
    _add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from llmem_plugin.models import catalog
    from llmem_plugin.models.tasks import config_task

    gpu = _gpu(args) if args.gpu or args.gpu_memory else None
    rows = []
    for name in catalog.names():
        e = catalog.entry(name)
        config = catalog.load_config(name)
        params, layers = catalog.count_parameters(config)
        row = {"name": name, "hub_id": e.hub_id, "family": e.family, "task": config_task(config).value,
               "num_layers": layers, "params": params}
        if gpu is not None:
            # bf16 weights alone (2 bytes per parameter): a first filter, not an estimate.
            row["gpu"] = gpu.name
            row["bf16_weights_pct_of_gpu"] = round(100 * 2 * params / gpu.capacity_bytes, 1)
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_models

        render_models(rows, Console())
    return 0


def _parser_gpus(sub) -> None:
    p = sub.add_parser("gpus", help="list the bundled GPU catalog: memory, dense peak TFLOP/s, interconnect")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="show only these GPUs (catalog name, alias, or the device name torch reports)")
    _add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=_cmd_gpus)


def _cmd_gpus(args: argparse.Namespace) -> int:
    from llmem_plugin.device import gpus

    names = list(args.names) + ([args.gpu] if args.gpu else [])
    if args.gpu_memory is not None:
        rows = [gpus.resolve_gpu(n, args.gpu_memory).to_dict() for n in names or [None]]
    else:
        rows = [gpus.get_gpu(n).to_dict() for n in names or gpus.gpu_names()]
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_gpus

        render_gpus(rows, Console())
    return 0


def _parser_validate(sub) -> None:
    p = sub.add_parser("validate", help="re-predict measured runs (ground-truth JSONL) and report the %% error")
    p.add_argument("file", metavar="FILE.jsonl", nargs="?", default=None,
                   help="rows written by benchmarks/groundtruth (not with --published)")
    p.add_argument("--published", nargs="?", const="", default=None, metavar="FILE",
                   help="re-predict third-party published figures (default: benchmarks/published/measurements.jsonl "
                        "of a source checkout) and print the signed error per metric")
    p.add_argument("--gpu", default=None, help="predict CUDA rows for this catalog GPU instead of each row's own")
    p.add_argument("--fast", action="store_true", help="predict with the layer-extrapolating fast mode")
    p.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.verify.validate import load_rows, validate_rows

    if args.published is not None:
        if args.gpu or args.fast:
            raise ConfigError("--published predicts each row for its own GPU, in fast mode (equal to the full "
                              "trace); --gpu and --fast do not apply. HINT: drop them")
        if args.file:
            raise ConfigError(f"validate takes a ground-truth FILE or --published, not both (got {args.file}). "
                              "HINT: pass the published set as --published FILE")
        return _validate_published(args)
    if not args.file:
        raise ConfigError("validate needs a ground-truth FILE.jsonl. HINT: llmem validate ROWS.jsonl, "
                          "or llmem validate --published")
    rows = load_rows(args.file)
    if args.gpu:
        from llmem_plugin.device.gpus import get_gpu

        get_gpu(args.gpu)  # a bad name is bad input, not a per-row failure
    report = validate_rows(rows, fast=args.fast, gpu=args.gpu)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_validation

        render_validation(report, Console())
    return 0


def _validate_published(args: argparse.Namespace) -> int:
    from llmem_plugin.verify.published import load_published, validate_published

    result = validate_published(load_published(args.published or None))
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    def stats(what: str, s: dict) -> str:
        return (f"{what}: {s['rows']} rows, mean |err| {s['mean_abs_pct']:.1f}%, mean signed "
                f"{s['mean_signed_pct']:+.1f}%, max |err| {s['max_abs_pct']:.1f}%")

    for metric, s in result["summary"].items():
        table = Table(title=stats(metric, s))
        for col in ("id", "measured GiB", "predicted GiB", "error"):
            table.add_column(col, overflow="fold")
        for r in result["rows"]:
            if r["metric"] == metric and r["error_pct"] is not None:
                table.add_row(r["id"], f"{r['measured'] / 2**30:.2f}", f"{r['predicted'] / 2**30:.2f}",
                              f"{r['error_pct']:+.1f}%")
        console.print(table)
    if result["reserved_pooled"]:
        console.print(stats("reserved memory, both metrics", result["reserved_pooled"]))
    refused = [r for r in result["rows"] if r["status"] == "modelled" and r["error"]]
    for r in refused:
        console.print(f"refused: {r['id']}: {r['error']}")
    console.print(f"{result['unsupported']} rows not modelled (their reasons: --json, or the file's 'why')")
    return 0


_EXIT_CODES = (
    "exit codes: 0 success (estimate: the step fits); 2 bad input, one line on stderr naming the value and the "
    "fix; 3 does not fit (estimate: the step or no method fits the GPU; plan: no method fits), the report is "
    "still printed"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmem", description="Peak GPU memory of LLM fine-tuning, predicted before the job starts.",
        epilog=_EXIT_CODES,
    )
    from importlib.metadata import PackageNotFoundError, version

    try:
        own_version = version("llmem_plugin")
    except PackageNotFoundError:  # run from a source tree that is not installed
        own_version = "unknown"
    parser.add_argument("--version", action="version", version=f"llmem {own_version}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _parser_estimate(sub)
    _parser_plan(sub)
    _parser_models(sub)
    _parser_validate(sub)
    _parser_gpus(sub)
    for p in sub.choices.values():
        p.epilog = _EXIT_CODES
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``llmem``.

    Parses ``argv`` (``sys.argv[1:]`` if None), refuses bad options before any
    model is built, and runs the command. torch is imported only once the
    options are valid, so ``--help`` and option errors are quick.

    Returns:
        The exit code: 0, ``EXIT_BAD_INPUT`` (2) or ``EXIT_WONT_FIT`` (3);
        ``--help`` returns 0.
    """
    from llmem_plugin.errors import LLMemError, WontFitError

    try:
        argv, recipe = _with_config(list(sys.argv[1:] if argv is None else argv))
    except LLMemError as e:  # the --config file cannot be read or mapped
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or an option argparse refused (its one line is printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.recipe = recipe
    try:
        _check_args(args)
        _check_config(args)
        return args.func(args)
    except WontFitError as e:
        print(f"llmem: {_one_line(e)}", file=sys.stderr)
        return EXIT_WONT_FIT
    except LLMemError as e:
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ImportError as e:
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _with_config(argv: list[str]):
    """``argv`` with the ``--config`` file's options put before the user's (so the user's win), and the recipe."""
    _Parser.origins = {}
    if not argv or argv[0] not in ("estimate", "plan"):
        return argv, None
    path = fmt = None
    for i, a in enumerate(argv):
        for flag in ("--config", "--config-format"):
            if a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            if flag == "--config":
                path = value
            else:
                fmt = value
    if path is None:
        return argv, None
    from llmem_plugin.recipes import command_argv, read_recipe

    import os

    recipe = read_recipe(path, fmt)
    typed = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}  # the user's own, named as such
    _Parser.origins = {m.option.split(" ")[0]: f"{os.path.basename(recipe.path)}: {m.key}"
                       for m in recipe.mapped if m.option and m.option.split(" ")[0] not in typed}
    return [argv[0], *command_argv(recipe, argv[0], argv[1:]), *argv[1:]], recipe


def _check_config(args: argparse.Namespace) -> None:
    """``--model-config`` replaces the file's model; a file's model must be in the catalog or a local path."""
    import os

    from llmem_plugin.errors import ConfigError

    recipe = args.recipe
    if recipe is not None and recipe.bf16_key and getattr(args, "gpu", None) is not None:
        from llmem_plugin.device.gpus import get_gpu

        gpu = get_gpu(args.gpu)
        if tuple(gpu.compute_capability) < (8, 0):  # bf16 tensor cores start with Ampere (sm_80)
            raise ConfigError(f"{os.path.basename(recipe.path)}: {recipe.bf16_key} needs bf16, which the {gpu.name} "
                              f"(compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}) lacks; "
                              "the framework would fail or train in fp16, which is not modelled. HINT: pass an "
                              "Ampere or later --gpu, or set fp32 in the file")
    if getattr(args, "model_config", None) is not None:
        if args.recipe is None:
            raise ConfigError(f"--model-config {args.model_config!r} names the model of a --config file. HINT: "
                              f"without --config pass --model {args.model_config}")
        if not os.path.exists(args.model_config):
            raise ConfigError(f"--model-config {args.model_config!r}: no such file. HINT: pass the model's "
                              "config.json")
        args.model = args.model_config
        return
    if args.recipe is not None and args.model == args.recipe.options.get("--model"):
        from llmem_plugin.models import catalog
        from llmem_plugin.models.litgpt import is_litgpt_source

        if catalog.lookup(args.model) is None and not os.path.exists(args.model) and not is_litgpt_source(args.model):
            key = next((m.key for m in args.recipe.mapped if m.option.startswith("--model ")), "model")
            raise ConfigError(f"{os.path.basename(args.recipe.path)}: {key}={args.model} is not in the bundled "
                              "catalog, and nothing is downloaded. HINT: pass --model-config path/to/config.json "
                              "(the model's config), or --model with a catalog name from `llmem models`")


def _emit_json(args: argparse.Namespace, result: dict) -> None:
    if getattr(args, "recipe", None) is not None:
        result = {**result, "config": args.recipe.to_dict()}
    print(json.dumps(result))


def _render_recipe(args: argparse.Namespace, console) -> None:
    if getattr(args, "recipe", None) is not None:
        from llmem_plugin.cli.report import render_recipe

        render_recipe(args.recipe, console)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
