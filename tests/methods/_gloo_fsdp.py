"""FSDP2 collectives for real gloo runs whose memory is compared with a fake trace.

gloo runs collectives on its own threads, which drop their references to the
tensors when they like, and its reduce_scatter stages a copy of the whole
input. NCCL allocates nothing of the kind (and the fake group nothing at all),
so gloo works on untracked copies here: the step's own tensors are freed when
FSDP drops them, deterministically.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from llmem_plugin.trace import _pause


class GlooAllGather(DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with _pause.untracked():
            out, inp = output_tensor.clone(), input_tensor.clone()
            super().__call__(out, inp, group, async_op=False)
            output_tensor.copy_(out)


class GlooReduceScatter(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with _pause.untracked():
            out, inp = output_tensor.clone(), input_tensor.clone()
            super().__call__(out, inp, group, op, async_op=False)
            output_tensor.copy_(out)


def use_gloo_collectives(*modules: nn.Module) -> None:
    """Give every FSDP2 module under ``modules`` the untracked gloo collectives."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(GlooAllGather())
                m.set_custom_reduce_scatter(GlooReduceScatter())
