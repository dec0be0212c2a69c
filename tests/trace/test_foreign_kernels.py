"""A trace uses PyTorch's own Meta kernels after ColossalAI's booster replaced them.

Each case runs in a fresh interpreter: importing ``colossalai.booster`` replaces aten
Meta kernels process-wide (``colossalai/_analyzer/_subclasses/_meta_registration.py``).
The independent checks are PyTorch itself: a real CPU run of the same step, the
alias a replaced ``roll`` returns, and the estimate made in a process without ColossalAI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("colossalai")

_ROOT = Path(__file__).resolve().parents[2]

_ROLL = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

def roll_aliases_its_input():
    with FakeTensorMode():
        x = torch.empty(2, 32, dtype=torch.int64)
        return torch.roll(x, -1, 1).untyped_storage()._cdata == x.untyped_storage()._cdata
"""


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=_ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_reference_model_step_fake_equals_real_with_colossalai_imported():
    # The reference forward shifts labels with torch.roll; ColossalAI's roll returns its input.
    code = _ROLL + """
import colossalai.booster
from llmem_plugin.trace.foreign_kernels import pytorch_meta_kernels
from tests.techniques.test_reference import _trace
from llmem_plugin.workload import Workload
print(roll_aliases_its_input())
with pytorch_meta_kernels():
    print(roll_aliases_its_input())
print(roll_aliases_its_input())
for lora in (None, {"rank": 8}):
    wl = Workload(seq_len=32, micro_batch_size=2, lora=lora, reference_model=True)
    fake, real = _trace(wl, real=False), _trace(wl, real=True)
    print(fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
          and [e[2] for e in fake.events] == [e[2] for e in real.events])
"""
    # The premise (ColossalAI's kernel aliases), PyTorch's inside, the user's back after; then both traces.
    assert _run(code) == ["True", "False", "True", "True", "True"]


def test_mllama_bias_free_patch_convolution_estimates_as_without_colossalai():
    # Mllama's patch embedding is a Conv2d without bias: ColossalAI's convolution_backward
    # calls torch.empty(bias_sizes) with bias_sizes=None.
    code = """
import sys
if sys.argv[1:] == ["colossal"]:
    import colossalai.booster
import llmem_plugin
from tests.models.test_tasks import _mllama
print(llmem_plugin.estimate(_mllama(), seq_len=32, images=1).peak_tensor_bytes)
"""
    def run(*args):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=_ROOT, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.split()[-1])

    assert run("colossal") == run()
