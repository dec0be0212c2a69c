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


def run_cases(tmp_path_factory, cases, *, steps: int) -> list[dict]:
    """The rows of ``cases`` run on the stub by the ground-truth harness, ``steps`` optimizer steps each."""
    import json

    from benchmarks.groundtruth import run

    out = tmp_path_factory.mktemp("stub") / "rows.jsonl"
    assert run.main(["--device", "stub", "--out", str(out), "--steps", str(steps), "--only", *cases]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]
