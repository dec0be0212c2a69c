"""Optimizer states and step temporaries equal closed forms and real CPU runs.

The closed forms come from the framework sources:
* bitsandbytes/optim/optimizer.py (0.50.2), Optimizer2State.init_state:
  parameters below ``min_8bit_size`` (4096 elements, adamw.py default) keep
  two fp32 states; larger ones under an 8-bit optimizer keep two uint8
  states and, per state, one fp32 absmax per block of 256 elements; the two
  256-entry fp32 quantization maps are copied to the device once.
  Optimizer8bit.get_state_buffer: a paged optimizer puts states of
  parameters with at least 1e5 elements in CUDA managed memory.
* torch/optim/adam.py (2.13), _single_tensor_adam (foreach=False,
  not capturable): per parameter, ``exp_avg_sq.sqrt()`` and its division by
  the bias correction both exist at once, while the previous parameter's
  ``denom`` is still bound; all in the parameter dtype.
* every tensor is a CUDA allocation rounded up to 512 B (kMinBlockSize).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from llmem_plugin.models import modelbuild
from llmem_plugin.cli.app import main
from llmem_plugin.errors import ConfigError
from llmem_plugin.estimate import _trace, estimate
from llmem_plugin.methods import method_names
from llmem_plugin.techniques.optim import make_bnb_optimizer, unsupported
from llmem_plugin.techniques import check_supported
from llmem_plugin.trace.tracker import MemoryCategory as C
from llmem_plugin.trace.tracker import MemoryTracker, Phase, round_allocation
from llmem_plugin.workload import OptimizerKind, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real

try:
    import bitsandbytes as bnb
except ImportError:
    bnb = None
# Only the tests that run bitsandbytes' own class need it; the layout tests run
# the estimator's stand-in when it is absent (llmem_plugin.techniques.optim._LayoutOptimizer).
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs bitsandbytes (pip install bitsandbytes)")

BNB_KINDS = ["adamw8bit", "paged-adamw", "paged-adamw8bit"]
# vocab 2048 x hidden 64 = 131072 elements: the embedding and lm_head are
# paged (>= 1e5); q_proj (64 x 64 = 4096) is exactly at min_8bit_size and
# k_proj (64 x 32 = 2048) and the norms are below it.
CFG = {"vocab_size": 2048}


def bnb_layout(params, kind: str) -> tuple[int, int]:
    """(caching-allocator bytes, managed bytes) of the optimizer's states."""
    eight_bit = kind.endswith("8bit")
    paged = kind.startswith("paged")
    device = managed = 0
    any_8bit = False
    for p in params:
        n = p.numel()
        is_8bit = eight_bit and n >= 4096
        any_8bit |= is_8bit
        state = n * (1 if is_8bit else 4)
        if paged and n >= 100_000:
            managed += 2 * state
        else:
            device += 2 * round_allocation(state)
        if is_8bit:
            device += 2 * round_allocation(4 * math.ceil(n / 256))  # absmax1, absmax2
    if any_8bit:
        device += 2 * round_allocation(256 * 4)  # qmap1, qmap2
    return device, managed


def trainable(model):
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def optimizer_states(wl: Workload):
    model = modelbuild.build_model(tiny_config("llama", **CFG), wl)
    params = trainable(model)
    return params, _trace(model, wl).phase_breakdowns[Phase.OPTIMIZER][C.OPTIMIZER_STATE]


@pytest.mark.parametrize("kind", BNB_KINDS)
def test_bnb_state_bytes_equal_the_bitsandbytes_layout(kind):
    params, states = optimizer_states(Workload(seq_len=16, precision="fp32", optimizer=kind))
    assert {p.numel() for p in params} >= {64, 2048, 4096, 131072}  # every branch of the layout
    device, managed = bnb_layout(params, kind)
    assert states == device
    assert (managed > 0) == kind.startswith("paged")


def test_the_knob_moves_optimizer_states_by_the_closed_form():
    params, adamw = optimizer_states(Workload(seq_len=16, precision="fp32", optimizer="adamw"))
    _, eight = optimizer_states(Workload(seq_len=16, precision="fp32", optimizer="adamw8bit"))
    torch_states = sum(2 * round_allocation(4 * p.numel()) for p in params)
    assert adamw == torch_states
    assert adamw - eight == torch_states - bnb_layout(params, "adamw8bit")[0]


@pytest.mark.parametrize("kind", ["paged-adamw", "paged-adamw8bit"])
def test_paged_states_count_in_device_total_but_not_in_the_allocator(kind):
    cfg = tiny_config("llama", **CFG)
    est = estimate(cfg, seq_len=16, precision="fp32", optimizer=kind)
    params = trainable(modelbuild.build_model(cfg, est.workload))
    _, managed = bnb_layout(params, kind)
    assert est.paged_bytes == managed > 0
    assert est.device_total_bytes == est.peak_reserved_bytes + est.overheads.outside_allocator_bytes + managed
    # The allocator replay never saw them: the same trace without paging
    # (adamw8bit) holds exactly the managed bytes more in the caching allocator.
    if kind == "paged-adamw8bit":
        plain = estimate(cfg, seq_len=16, precision="fp32", optimizer="adamw8bit")
        assert plain.paged_bytes == 0
        assert (plain.breakdown[C.OPTIMIZER_STATE] - est.breakdown[C.OPTIMIZER_STATE]
                == sum(2 * round_allocation(p.numel()) for p in params if p.numel() >= 100_000))


@pytest.mark.parametrize(("kind", "precision"), [
    ("adamw-forloop", "fp32"), ("adamw-forloop", "bf16"), ("adamw8bit", "fp32"), ("adamw8bit", "bf16"),
    ("paged-adamw8bit", "bf16-mixed"),
])
def test_fake_trace_equals_real_cpu_run(kind, precision):
    if kind != "adamw-forloop" and bnb is None:
        pytest.skip("the real CPU run of a bitsandbytes optimizer needs bitsandbytes (pip install bitsandbytes)")
    wl = Workload(seq_len=32, precision=precision, optimizer=kind)
    fake, real = fake_and_real(tiny_config("llama", **CFG), wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.phase_breakdowns == real.phase_breakdowns
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


@needs_bnb
@pytest.mark.parametrize("kind", BNB_KINDS)
def test_emulation_trains_exactly_as_bitsandbytes_on_cpu(kind):
    torch.manual_seed(0)
    shapes = [(500, 300), (64, 64), (40, 50), (10,)]
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ref_cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged-adamw": bnb.optim.PagedAdamW,
               "paged-adamw8bit": bnb.optim.PagedAdamW8bit}[kind]
    a, b = make_bnb_optimizer(ours, OptimizerKind(kind), lr=1e-3), ref_cls(theirs, lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        for _ in range(2):
            for p, q in zip(ours, theirs):
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            a.step()
            b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        sa, sb = a.state[p], b.state[q]
        assert sa.keys() == sb.keys()
        for key, v in sa.items():
            if isinstance(v, torch.Tensor):
                assert (v.shape, v.dtype) == (sb[key].shape, sb[key].dtype) and torch.equal(v, sb[key]), key
            else:
                assert v == sb[key] == 2
    assert a.paged_bytes == bnb_layout(ours, kind)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_forloop_step_temporaries_equal_the_closed_form(dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, dtype=dtype)) for s in [(1000,), (64, 64), (10,), (300, 7)]]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the states
    live = params + [p.grad for p in params] + [v for st in opt.state.values() for v in st.values()]
    tracker = MemoryTracker()
    with tracker:
        tracker.register(live, C.PARAMETER)
        base = tracker.live_bytes()
        opt.step()
    size = [round_allocation(p.numel() * p.element_size()) for p in params]
    expected = max((size[i - 1] if i else 0) + 2 * size[i] for i in range(len(size)))
    assert tracker.result().peak_bytes - base == expected


def test_unsupported_names_every_method_it_refuses():
    eight, paged = Workload(optimizer="adamw8bit"), Workload(optimizer="paged-adamw8bit")
    own = {"zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "gemini", "lowlevel-zero1",
           "lowlevel-zero2", "hybrid"}
    dtensor = {"fsdp", "hsdp", "tp", "dp-tp", "fsdp-tp"}
    pipeline = {"pp", "pp-gpipe", "pp-interleaved", "pp-zbv", "pp-dualpipev", "pp-interleaved-zb"}
    assert set(method_names()) == own | dtensor | pipeline | {"single", "ddp"}
    for method in [*method_names(), "single"]:
        assert unsupported(method, Workload(optimizer="adamw")) is None
        reason = unsupported(method, eight)
        if method in own | dtensor | pipeline:
            assert f"--method {method}" in reason and "HINT:" in reason
            with pytest.raises(ConfigError, match="adamw8bit"):
                check_supported(method, eight)
        else:
            assert reason is None
        assert (unsupported(method, paged) is None) == (method == "single")


def test_ddp_traces_the_8bit_states_of_the_bitsandbytes_layout():
    from llmem_plugin.methods import estimate_method
    from llmem_plugin.methods.layout import Layout

    cfg = tiny_config("llama", **CFG)
    wl = Workload(seq_len=16, precision="fp32", optimizer="adamw8bit")
    rank = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu=None).worst
    params = trainable(modelbuild.build_model(cfg, wl))
    assert rank.phase_breakdowns["optimizer"]["optimizer_states"] == bnb_layout(params, "adamw8bit")[0]


def test_cli_estimate_with_a_paged_8bit_optimizer(capsys):
    code = main(["estimate", "--model", "gpt2", "--seq-len", "1024", "--optimizer", "paged-adamw8bit", "--fast",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    params = trainable(modelbuild.build_model("gpt2", Workload(optimizer="paged-adamw8bit", seq_len=1024),
                                              device="meta"))
    # Every gpt2 matrix is above 1e5 elements: uint8 state1 + state2 in managed memory.
    assert data["paged_bytes"] == sum(2 * p.numel() for p in params if p.numel() >= 100_000) > 200 * 2**20
    outside = data["device_total_bytes"] - data["peak_reserved_bytes"] - data["paged_bytes"]
    assert outside == data["overheads"]["cuda_context_bytes"]


# ----------------------------------------------------------------------------- without bitsandbytes




def _events(kind: str):
    wl = Workload(seq_len=16, precision="fp32", optimizer=kind)
    model = modelbuild.build_model(tiny_config("llama", **CFG), wl)
    result = _trace(model, wl)
    return [(e[1], e[2]) for e in result.events], result


@pytest.mark.parametrize("kind", BNB_KINDS)
def test_without_bitsandbytes_the_states_are_allocated_as_bitsandbytes_allocates_them(kind, request):
    """The stand-in allocates bitsandbytes' states event for event (bitsandbytes
    0.50.2 optim/optimizer.py, Optimizer2State.init_state: state1, state2,
    then absmax1/absmax2 of ceil(n / 256) fp32 for 8-bit states, qmaps copied
    once), and the same managed bytes."""
    with_bnb = _events(kind)[0] if bnb is not None else None
    request.getfixturevalue("no_bitsandbytes")
    from llmem_plugin.techniques.optim import _LayoutOptimizer

    params = trainable(modelbuild.build_model(tiny_config("llama", **CFG), Workload(optimizer=kind)))
    assert isinstance(make_bnb_optimizer(params, OptimizerKind(kind), lr=1e-3), _LayoutOptimizer)
    events, result = _events(kind)
    wl = Workload(seq_len=16, precision="fp32", optimizer=kind)
    device, managed = bnb_layout(trainable(modelbuild.build_model(tiny_config("llama", **CFG), wl)), kind)
    assert result.phase_breakdowns[Phase.OPTIMIZER][C.OPTIMIZER_STATE] == device
    if with_bnb is not None:
        assert events == with_bnb
    est = estimate(tiny_config("llama", **CFG), seq_len=16, precision="fp32", optimizer=kind)
    assert est.paged_bytes == managed


def test_without_bitsandbytes_a_real_step_is_refused_with_the_package_to_install(no_bitsandbytes):
    p = torch.nn.Parameter(torch.randn(64, 64))
    p.grad = torch.randn_like(p)
    opt = make_bnb_optimizer([p], OptimizerKind.ADAMW_8BIT, lr=1e-3)
    with pytest.raises(ImportError, match="needs bitsandbytes .*HINT: pip install bitsandbytes"):
        opt.step()


def test_without_bitsandbytes_gpt2_is_estimated_with_an_8bit_optimizer(no_bitsandbytes):
    est = estimate("gpt2", optimizer="adamw8bit", fast=True, seq_len=1024)  # GPT-2 learns 1,024 positions
    params = trainable(modelbuild.build_model("gpt2", Workload(optimizer="adamw8bit", seq_len=1024), device="meta"))
    # every gpt2 matrix is above min_8bit_size: uint8 state1 + state2 and ceil(n / 256) fp32 absmax each
    big = [p for p in params if p.numel() >= 4096]
    states = sum(2 * round_allocation(p.numel()) + 2 * round_allocation(4 * math.ceil(p.numel() / 256)) for p in big)
    states += sum(2 * round_allocation(4 * p.numel()) for p in params if p.numel() < 4096)
    states += 2 * round_allocation(4 * 256)
    assert est.breakdown[C.OPTIMIZER_STATE] == states


@needs_bnb
@pytest.mark.parametrize("kind", BNB_KINDS)
def test_the_stand_in_keeps_the_states_of_a_real_bitsandbytes_step(kind, monkeypatch):
    """State for state, the stand-in (on fake tensors) keeps what bitsandbytes'
    own optimizer keeps after a real CPU step: same keys, shapes and dtypes."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    shapes = [(500, 300), (64, 64), (40, 50), (10,)]  # above and below min_8bit_size and the paging threshold
    ref_cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged-adamw": bnb.optim.PagedAdamW,
               "paged-adamw8bit": bnb.optim.PagedAdamW8bit}[kind]
    real = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    ref = ref_cls(real, lr=1e-3)
    for p in real:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: "Paged optimizers are not supported on CPU"
        ref.step()
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with FakeTensorMode():
        fake = [torch.nn.Parameter(torch.empty(*s)) for s in shapes]
        ours = make_bnb_optimizer(fake, OptimizerKind(kind), lr=1e-3)
        assert type(ours).__name__ == "_LayoutOptimizer"
        for p in fake:
            p.grad = torch.empty_like(p)
        ours.step()
    for p, q in zip(fake, real):
        a, b = ours.state[p], ref.state[q]
        assert list(a) == list(b)
        for key in a:
            if isinstance(b[key], torch.Tensor):
                assert (tuple(a[key].shape), a[key].dtype) == (tuple(b[key].shape), b[key].dtype), key
            else:
                assert a[key] == b[key] == 1, key
