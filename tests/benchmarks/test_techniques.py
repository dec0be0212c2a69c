"""The ground-truth harness's real-library paths (benchmarks/groundtruth/techniques.py), on the CPU.

The GPU cannot be reached here, so each path that runs on the CPU runs on a
tiny Llama (2 layers, hidden 64, vocab 512): bitsandbytes 4-bit and 8-bit
quantization and its optimizers (bitsandbytes 0.50.2 has CPU kernels),
the chunked and logits_to_keep losses, save_on_cpu and both reference
forwards. Values are checked against the model's own loss and a naive
log-softmax; the quantized layout against bitsandbytes' documented packing.
Paths whose library is CUDA-only must skip with a reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.groundtruth import cuda, techniques
from benchmarks.groundtruth.matrix import CPU_CASES, TECHNIQUE_CASES, Case
from llmem_plugin.workload import LoraSpec, Workload

TINY = dict(next(c for c in CPU_CASES if c.model == "llama-3.2-1b").config_overrides)
SEQ, BATCH = 32, 2


def tiny_case(**fields) -> Case:
    wl = Workload(seq_len=SEQ, micro_batch_size=BATCH, attn_implementation="sdpa", **fields)
    return Case(id="tiny-technique", model="llama-3.2-1b", workload=wl, config_overrides=tuple(sorted(TINY.items())))


def build(case: Case, seed: int = 0):
    torch.manual_seed(seed)
    return techniques.build_model(case, device="cpu")


def ids(vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


class StubRecorder:
    step_in_progress = 0

    def __init__(self) -> None:
        self.steps: list[int] = []

    def reset(self) -> None:
        pass

    def record(self, step: int) -> None:
        self.steps.append(step)


def train(model, case: Case, steps: int = 2) -> None:
    rec = StubRecorder()
    cuda._torch_loop(model, case, steps, rec, device="cpu")
    assert rec.steps == list(range(1, steps + 1))


# --- QLoRA with real bitsandbytes --------------------------------------------------------------

QUANT = [("nf4", True), ("fp4", False)]


@pytest.mark.parametrize(("quant", "dq"), QUANT)
def test_4bit_layout_is_bitsandbytes_packing(quant, dq):
    import bitsandbytes as bnb

    case = tiny_case(precision="bf16-mixed", lora=LoraSpec(rank=4), quantize=quant, double_quant=dq)
    plain = build(tiny_case(precision="bf16-mixed"))
    linears = {n: m for n, m in plain.named_modules() if type(m) is torch.nn.Linear}
    model = build(case)
    quantized = {n.removeprefix("base_model.model.").removesuffix(".base_layer"): m
                 for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    # transformers' get_keys_to_not_convert keeps the output embedding (lm_head) unquantized.
    assert set(quantized) == set(linears) - {"lm_head"}
    for name, m in quantized.items():
        n = linears[name].weight.numel()
        w = m.weight
        # bitsandbytes/functional.py quantize_4bit: two 4-bit codes per uint8 byte, shape (ceil(n/2), 1);
        # one absmax per block of 64 (Linear4bit's default blocksize), 8-bit with double quantization.
        assert w.dtype == torch.uint8 and tuple(w.shape) == (math.ceil(n / 2), 1)
        assert w.quant_state.quant_type == quant and w.quant_state.blocksize == 64
        assert w.quant_state.absmax.numel() == math.ceil(n / 64)
        assert w.quant_state.absmax.dtype == (torch.uint8 if dq else torch.float32)
        assert (w.quant_state.state2 is not None) == dq
    # peft prepare_model_for_kbit_training casts every other bf16 weight to fp32.
    others = [p for n, p in model.named_parameters() if "lora_" not in n and p.dtype != torch.uint8]
    assert others and all(p.dtype == torch.float32 and not p.requires_grad for p in others)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # LoRA r=4 on q/k/v/o of 2 layers: r * (in + out) each; q, o: 64 -> 64, k, v: 64 -> 32 (2 KV heads x 16).
    assert trainable == 2 * 4 * ((64 + 64) * 2 + (64 + 32) * 2)


def test_qlora_without_kbit_preparation_keeps_16bit_parameters():
    case = tiny_case(precision="bf16", lora=LoraSpec(rank=4), quantize="nf4", kbit_prepare="off")
    model = build(case)
    frozen = {p.dtype for n, p in model.named_parameters() if not p.requires_grad and p.dtype != torch.uint8}
    assert frozen == {torch.bfloat16}  # norms and embeddings stay bf16 (prepare_model_for_kbit_training would make them fp32)
    train(model, case)


def test_qlora_trains_adapters_only_on_cpu():
    case = tiny_case(precision="bf16-mixed", lora=LoraSpec(rank=4), quantize="nf4", double_quant=True)
    model = build(case)
    packed = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    lora_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    train(model, case)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in packed.items())
    assert any(not torch.equal(after[n], p) for n, p in lora_b.items())  # B starts at zero and moves


def test_int8_layout_and_training_on_cpu():
    import bitsandbytes as bnb

    case = tiny_case(precision="bf16-mixed", lora=LoraSpec(rank=4), quantize="int8")
    model = build(case)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(layers) == 2 * 7  # q k v o gate up down per layer; lm_head kept
    for m in layers:
        # bitsandbytes Int8Params: int8 (out, in) and one fp32 scale per output row (SCB).
        assert m.weight.dtype == torch.int8 and m.weight.SCB.shape == (m.out_features,)
        assert m.weight.SCB.dtype == torch.float32
    train(model, case, steps=1)


# --- optimizers --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adamw8bit", "paged-adamw8bit", "paged-adamw"])
def test_bitsandbytes_optimizer_states(kind):
    case = tiny_case(precision="bf16-mixed", optimizer=kind)
    model = build(case)
    train(model, case, steps=1)
    import bitsandbytes as bnb

    opt = techniques.make_optimizer(list(model.parameters()), case.workload.optimizer)
    assert isinstance(opt, bnb.optim.optimizer.Optimizer2State)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning) if kind.startswith("paged") else _no_warning():
        opt.step()
    for p in model.parameters():
        st = opt.state[p]
        # bitsandbytes/optim/optimizer.py Optimizer2State.init_state: 8-bit states only for tensors
        # of at least min_8bit_size = 4096 elements (its default); others keep fp32 states.
        eight = kind.endswith("8bit") and p.numel() >= 4096
        assert st["state1"].dtype == (torch.uint8 if eight else torch.float32)
        assert st["state1"].shape == p.shape and st["state2"].shape == p.shape
        if eight:  # blockwise absmax: one fp32 per 256 elements (blocksize 256)
            assert st["absmax1"].numel() == math.ceil(p.numel() / 256)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_forloop_adamw_is_torchs():
    case = tiny_case(optimizer="adamw-forloop")
    opt = techniques.make_optimizer(list(build(case).parameters()), case.workload.optimizer)
    assert type(opt) is torch.optim.AdamW and opt.defaults["foreach"] is False


# --- losses --------------------------------------------------------------------------------------

def test_chunked_loss_equals_the_models_own_loss():
    model = build(tiny_case(precision="fp32"))
    x = ids()
    ref = model(input_ids=x, labels=x, use_cache=False).loss
    ref_grad = torch.autograd.grad(ref, model.lm_head.weight)[0]
    for chunks in (1, 3, 8):
        loss = techniques.chunked_loss(model, x, x, chunks)
        grad = torch.autograd.grad(loss, model.lm_head.weight)[0]
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grad, ref_grad)
    loss = techniques.no_upcast_loss(model, x, x)  # fp32 model: the same cross-entropy without the .float()
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("keep", [SEQ, 8])
def test_logits_to_keep_scores_the_last_positions(keep):
    case = tiny_case(precision="fp32", logits_to_keep=keep)
    model = build(case)
    x = ids()
    loss = techniques.forward_loss(model, x, x, case.workload)
    # Independent: full logits, next-token CE over the predictions made at the last `keep` positions
    # whose target exists (position s-1 has none).
    logits = model(input_ids=x, use_cache=False).logits[:, -keep:-1]
    target = x[:, SEQ - keep + 1:]
    expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_sequence_logps_equal_a_naive_log_softmax():
    logits = torch.randn(3, 7, 11)
    x = torch.randint(0, 11, (3, 7))
    naive = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, x[:, 1:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(techniques.sequence_logps(logits, x).double(), naive)
    bf = techniques.sequence_logps(logits.bfloat16(), x)
    assert bf.dtype == torch.bfloat16 and bf.shape == (3,)
    torch.testing.assert_close(bf.double(), naive, atol=0.1, rtol=0.02)


# --- reference model and activation offload ----------------------------------------------------

def test_lora_reference_is_the_base_model():
    case = tiny_case(precision="fp32", lora=LoraSpec(rank=4), reference_model=True)
    model = build(case)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # adapters that change the output, so disabling them shows
    base = build(tiny_case(precision="fp32"))  # same seed: the same base weights
    x = ids()
    ref = techniques.reference_forward(model, case.workload)(x)
    assert not ref.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(ref, techniques.sequence_logps(base(input_ids=x).logits, x))
        policy = techniques.sequence_logps(model(input_ids=x).logits, x)
    assert not torch.allclose(ref, policy)


def test_full_reference_is_a_frozen_copy():
    case = tiny_case(precision="bf16", reference_model=True)
    model = build(case)
    fwd = techniques.reference_forward(model, case.workload)
    ref = fwd.model
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    own = {p.data_ptr() for p in model.parameters()}
    assert not own & {p.data_ptr() for p in ref.parameters()}
    assert sum(p.numel() for p in ref.parameters()) == sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())


def test_save_on_cpu_keeps_gradients():
    case = tiny_case(precision="fp32", offload_activations="save-on-cpu")
    model = build(case)
    x = ids()
    grads = []
    for ctx in (techniques.offload_factory(model, case.workload), techniques.offload_factory(model, tiny_case().workload)):
        model.zero_grad(set_to_none=True)
        with ctx():
            techniques.forward_loss(model, x, x, case.workload).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


TRAINABLE_ON_CPU = [
    {"precision": "bf16-mixed", "loss": "chunked"},
    {"precision": "bf16", "loss": "chunked", "loss_chunk_upcast": False},
    {"precision": "bf16", "loss": "no-upcast"},
    {"precision": "bf16-mixed", "logits_to_keep": 8},
    {"precision": "bf16-mixed", "offload_activations": "save-on-cpu", "grad_checkpointing": True},
    {"precision": "bf16-mixed", "lora": LoraSpec(rank=4), "reference_model": True},
    {"precision": "bf16", "reference_model": True, "grad_accum_steps": 2},
    {"precision": "bf16-mixed", "optimizer": "adamw-forloop"},
]


@pytest.mark.parametrize("fields", TRAINABLE_ON_CPU, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_cuda_loop_runs_each_technique_on_cpu(fields):
    case = tiny_case(**fields)
    model = build(case)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    train(model, case)
    after = [p for p in model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


# --- CUDA-only libraries ---------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "module"), [
    ({"precision": "bf16", "attn_implementation": "flash_attention_2"}, "flash_attn"),
    ({"loss": "liger"}, "liger_kernel"),
    ({"offload_activations": "streamed"}, "trl"),
])
def test_missing_library_skips_with_a_hint(fields, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    case = dataclasses.replace(tiny_case(), workload=dataclasses.replace(tiny_case().workload, **fields))
    with pytest.raises(techniques.Skipped, match=rf"'{module}.*HINT"):
        model = techniques.build_model(case, device="cpu")
        techniques.offload_factory(model, case.workload)


def test_technique_cases_are_torch_runner_cases_with_notes():
    assert TECHNIQUE_CASES and all(c.runner == "torch" and c.note for c in TECHNIQUE_CASES)
    with pytest.raises(ValueError, match="torch runner"):
        dataclasses.replace(TECHNIQUE_CASES[0], runner="hf-trainer")


# --- the matrix's technique cases ----------------------------------------------------------------

def _baseline(wl: Workload) -> Workload:
    """``wl`` without its technique: default technique fields, torch's AdamW, SDPA."""
    kind = wl.optimizer.value
    return dataclasses.replace(
        wl, quantize=None, double_quant=False, loss="hf", logits_to_keep=0, offload_activations=None,
        reference_model=False, optimizer="adamw" if kind in ("adamw8bit", "paged-adamw8bit", "paged-adamw",
                                                             "adamw-forloop") else kind,
        attn_implementation="sdpa" if wl.attn_implementation.value == "flash_attention_2" else wl.attn_implementation)


def test_technique_cases_cover_each_setting():
    from llmem_plugin.models import catalog

    by = {(c.model, c.workload.quantize and c.workload.quantize.value, c.workload.grad_checkpointing): c
          for c in TECHNIQUE_CASES}
    for gc in (False, True):  # QLoRA on Llama-3.1-8B at 2048 x 1 with and without checkpointing
        wl = by["llama-3.1-8b", "nf4", gc].workload
        assert wl.double_quant and wl.lora.rank == 16 and (wl.seq_len, wl.micro_batch_size) == (2048, 1)
    assert not by["llama-3.1-8b", "fp4", False].workload.double_quant
    int8 = next(c for c in TECHNIQUE_CASES if c.workload.quantize and c.workload.quantize.value == "int8")
    assert int8.workload.lora is not None and int8.model != "llama-3.1-8b"
    wls = [(c.model, c.workload) for c in TECHNIQUE_CASES]
    assert {w.optimizer.value for m, w in wls if m == "llama-3.2-1b" and w.lora is None} >= {
        "adamw8bit", "paged-adamw8bit", "paged-adamw", "adamw-forloop"}
    assert any(w.attn_implementation.value == "flash_attention_2" and w.precision.value == "bf16" for _, w in wls)
    assert {w.loss.value for m, w in wls if m == "llama-3.2-1b" and w.seq_len == 4096} == {"hf", "liger", "chunked", "cce"}
    assert any(w.logits_to_keep for _, w in wls)
    assert {w.offload_activations.value for m, w in wls if w.offload_activations and m == "llama-3.2-1b"} == {
        "save-on-cpu", "streamed"}
    assert {w.lora is not None for m, w in wls if w.reference_model and m == "qwen2.5-0.5b"} == {True, False}
    assert any("moe" in catalog.config_dict(m)["model_type"] for m, _ in wls)


def test_every_technique_case_has_a_baseline_in_the_matrix():
    from benchmarks.groundtruth.matrix import GPU_CASES

    plain = {(c.model, c.workload) for c in GPU_CASES if c.runner == "torch"}
    with_technique = [c for c in TECHNIQUE_CASES if c.workload != _baseline(c.workload)]
    assert len(with_technique) >= 15
    unpaired = [c.id for c in with_technique if (c.model, _baseline(c.workload)) not in plain]
    assert not unpaired


def test_ids_named_in_the_readme_exist():
    import re
    from pathlib import Path

    from benchmarks.groundtruth.matrix import GPU_CASES

    readme = (Path(__file__).parents[2] / "benchmarks" / "groundtruth" / "README.md").read_text()
    named = set(re.findall(r"(?<![\w.-])([a-z][\w.-]*-s\d+-b\d+[\w-]*)", readme))
    assert named and named <= {c.id for c in GPU_CASES + CPU_CASES}, named - {c.id for c in GPU_CASES + CPU_CASES}
