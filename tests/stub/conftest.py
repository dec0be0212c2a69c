"""Tests on the stub CUDA device (stubcuda/): PyTorch's CUDA build with no GPU.

They skip when the stub environment is not built here, and fail instead when
LLMEM_REQUIRE_STUB is set (as .ci/run sets it).
"""
import os

import pytest

from stubcuda import runner


@pytest.fixture(scope="session")
def stub():
    why = runner.missing()
    if why:
        if os.environ.get(runner.REQUIRE_ENV):
            pytest.fail(f"stub CUDA device required ({runner.REQUIRE_ENV} is set): {why}")
        pytest.skip(why)
    return runner
