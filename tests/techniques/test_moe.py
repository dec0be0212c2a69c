"""MoE experts: routing-free implementations trace exactly; the eager loop is bounded by its worst case.

Real CPU runs are measured by the same tracker, with the router's choice
forced by a forward hook: "one" sends every token to experts 0..top_k-1 (the
most rows one expert can get), "uniform" spreads the (token, slot) pairs
round-robin, "random" keeps the router's own choice.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from llmem_plugin.trace import _pause
from llmem_plugin.models import modelbuild
from llmem_plugin.techniques import moe
from llmem_plugin.estimate import estimate
from llmem_plugin.trace.step import trace_step
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, round_allocation
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config

ARCHS = ("mixtral", "qwen3_moe")
WL = Workload(seq_len=32, micro_batch_size=2, precision="bf16")


def _config(arch: str, impl: str | None = None, **overrides):
    if arch == "mixtral":
        cfg = tiny_config("mixtral", **overrides)
    else:
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=512, **overrides)
    if impl is not None:
        cfg._experts_implementation = impl
    return cfg


def _force(routing: str):
    """A router forward hook that overwrites the chosen experts in place,
    untracked (and past autograd's version check via ``.data``), so that the
    forced run allocates exactly what an unforced one does."""

    def hook(router, args, out):
        idx = out[2]
        tokens, k = idx.shape
        with _pause.untracked():
            if routing == "one":
                forced = torch.arange(k).expand(tokens, k)
            else:
                forced = (torch.arange(tokens * k) % router.num_experts).view(tokens, k)
            idx.data.copy_(forced)

    return hook


def _real(cfg, wl: Workload, routing: str):
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    if routing != "random":
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.register_forward_hook(_force(routing))
    return trace_step(model, wl, vocab_size=cfg.vocab_size)


def _fake(cfg, wl: Workload, *, bound: bool = True):
    model = modelbuild.build_model(cfg, wl, device="meta")
    if bound:
        moe.bound_eager_routing(model)
    fake_mode = FakeTensorMode()
    modelbuild.fakeify(model, fake_mode)
    return trace_step(model, wl, vocab_size=cfg.vocab_size, fake_mode=fake_mode)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_defaults_to_grouped_mm(arch):
    # modeling_utils.get_correct_experts_implementation: no request -> grouped_mm.
    model = modelbuild.build_model(_config(arch), WL, device="meta")
    assert model.config._experts_implementation == "grouped_mm"
    assert moe.experts_implementation(model.config) == "grouped_mm"
    assert moe.experts_implementation(tiny_config("llama")) is None


@pytest.mark.parametrize("impl", moe.ROUTING_FREE_IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_routing_free_experts_fake_equals_real_under_every_routing(arch, impl):
    cfg = _config(arch, impl)
    fake = _fake(cfg, WL)
    # The two extremes: the router's own spread, and every token on the same experts.
    for routing in ("random", "one"):
        real = _real(cfg, WL, routing)
        assert [e[2] for e in fake.events] == [e[2] for e in real.events], routing
        assert fake.phase_peaks == real.phase_peaks, routing


def _grouped_mm_forward_bytes(*, tokens: int, top_k: int, hidden: int, inter: int, experts: int,
                              param: int, weight: int) -> int:
    """Bytes allocated by transformers' grouped_mm_experts_forward (integrations/moe.py, 5.23), op
    by op; ``param``/``weight`` are the byte widths of the expert weights and of the routing weights.
    Every per-row term has S = tokens x top_k rows."""
    s = tokens * top_k
    promoted = max(param, weight)  # proj_out * routing weights promotes
    sizes = [
        8 * s, 8 * s,  # sort: sorted expert ids, permutation (int64)
        8 * s,  # perm // top_k
        s * hidden * param,  # hidden_states gathered by expert
        s * weight,  # routing weights gathered
        4 * s,  # histc input as float (CPU path)
        4 * experts, 4 * experts,  # histc counts, int32 offsets (one block each)
        s * 2 * inter * param,  # grouped_mm gate_up
        s * inter * param, s * inter * param,  # act(gate), act(gate) * up
        s * hidden * param,  # grouped_mm down
        s * hidden * promoted,  # * routing weights
        8 * s, 8 * s,  # inverse permutation: empty_like, arange
        s * hidden * promoted,  # rows back in token order
        tokens * hidden * promoted,  # sum over the top_k slots
    ]
    if promoted != param:
        sizes.append(tokens * hidden * param)  # .to(hidden_states.dtype)
    return sum(round_allocation(n) for n in sizes)


@pytest.mark.parametrize("tokens", [64, 40])
@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_mm_experts_allocate_a_closed_form_in_tokens_times_top_k(arch, tokens):
    cfg = _config(arch, "grouped_mm")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    block = model.model.layers[0].mlp
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    _, scores, _ = block.gate(x)
    experts = moe._routing_fields(cfg)[0]
    inter = cfg.intermediate_size if arch == "mixtral" else cfg.moe_intermediate_size
    expected = _grouped_mm_forward_bytes(tokens=tokens, top_k=cfg.num_experts_per_tok, hidden=cfg.hidden_size,
                                         inter=inter, experts=experts, param=2, weight=scores.element_size())
    for routing in ("random", "one", "uniform"):
        _, weights, idx = block.gate(x)
        if routing != "random":
            _force(routing)(block.gate, (), (None, None, idx))
        tracker = MemoryTracker()
        tracker.register(list(block.parameters()) + [x, weights, idx], MemoryCategory.PARAMETER)
        with tracker:
            out = block.experts(x, idx, weights)
        allocated = sum(n for sign, _, n in tracker.result().events if sign > 0)
        registered = sum(round_allocation(t.untyped_storage().nbytes())
                         for t in list(block.parameters()) + [x, weights, idx])
        assert allocated - registered == expected, routing
        del out


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_loop_cannot_trace_unbounded(arch):
    # nonzero has no size on values a fake tensor does not hold.
    with pytest.raises(DynamicOutputShapeException):
        _fake(_config(arch, "eager"), WL, bound=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_worst_case_bounds_real_runs_under_every_routing(arch):
    cfg = _config(arch, "eager")
    bound = _fake(cfg, WL)
    runs = {routing: _real(cfg, WL, routing) for routing in ("random", "one", "uniform")}
    for routing, real in runs.items():
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            assert bound.phase_peaks[phase] >= real.phase_peaks[phase], (routing, phase)
        assert bound.peak_bytes >= real.peak_bytes, routing
    # Not slack beyond the (num_experts - top_k) one-row experts: within
    # 512 B per allocation of a one-row expert's loop body (< 40 per layer).
    experts, top_k = moe._routing_fields(cfg)
    one = runs["one"]
    limit = cfg.num_hidden_layers * (experts - top_k) * 40 * 512
    assert bound.phase_peaks[Phase.FORWARD] - one.phase_peaks[Phase.FORWARD] <= limit


@pytest.mark.parametrize("arch", ARCHS)
def test_router_aux_loss_is_traced_as_run(arch):
    cfg = _config(arch, "grouped_mm", output_router_logits=True)
    fake, real = _fake(cfg, WL), _real(cfg, WL, "random")
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]
    off = _fake(_config(arch, "grouped_mm"), WL)
    # Each layer's (tokens x experts) router logits live until the loss.
    assert fake.phase_peaks[Phase.FORWARD] > off.phase_peaks[Phase.FORWARD]


def test_routing_note_and_estimate_notes():
    assert moe.routing_note(tiny_config("llama"), WL) is None
    grouped = moe.routing_note(_config("mixtral"), WL)
    assert "grouped_mm" in grouped and "64 tokens x top-2 = 128 rows" in grouped
    assert "does not depend" in grouped
    eager = moe.routing_note(_config("qwen3_moe", "eager"), WL)
    assert "worst case" in eager and "64 rows per expert" in eager
    aux = moe.routing_note(_config("mixtral", output_router_logits=True), WL)
    assert "router aux loss on" in aux
    est = estimate(_config("mixtral", "eager"), WL)
    assert est.notes == (moe.routing_note(_config("mixtral", "eager"), WL),)
    assert est.to_dict()["notes"] == list(est.notes)
    assert estimate(tiny_config("llama"), WL).notes == ()
    assert moe.unsupported("single", WL) is None


def _dbrx():
    # clip_qkv as DBRX's published config.json has it (8): transformers' DBRX
    # attention clamps with it unconditionally.
    return transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=512,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000, "clip_qkv": 8},
        ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2})


@pytest.mark.parametrize("routing", ["random", "one"])
def test_dbrx_experts_loop_is_bounded_by_its_worst_case(routing):
    """DBRX's experts (DbrxExperts, no experts-implementation switch) loop over
    the experts hit with nonzero/where: traced at the worst case, which bounds
    real runs under the router's own choice and with every token on the
    first top_k experts."""
    cfg = _dbrx()
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16")
    assert moe.experts_implementation(cfg) == "eager" and moe._routing_fields(cfg) == (4, 2)
    bound = _fake(cfg, wl)
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    if routing == "one":
        for m in model.modules():
            if type(m).__name__ == "DbrxFFN":
                def route(logits, _orig=m.route_tokens_to_experts):
                    weights, idx = _orig(logits)
                    with _pause.untracked():
                        idx.data.copy_(torch.arange(idx.shape[1]).expand_as(idx))  # past the version check
                    return weights, idx
                m.route_tokens_to_experts = route
    real = trace_step(model, wl, vocab_size=cfg.vocab_size)
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert bound.phase_peaks[phase] >= real.phase_peaks[phase], phase
    assert bound.peak_bytes >= real.peak_bytes
    if routing == "one":  # the same loop but for the one-row experts: within 40 blocks per layer each
        assert bound.phase_peaks[Phase.FORWARD] - real.phase_peaks[Phase.FORWARD] <= 2 * 2 * 40 * 512
    est = estimate(cfg, wl)
    assert est.notes == (moe.routing_note(cfg, wl),) and "worst case" in est.notes[0]
