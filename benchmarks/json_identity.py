"""The `--json` output of the benchmark configurations, for checking that a
change which should not move any figure moves none.

    python benchmarks/json_identity.py run OUT_DIR [CASE ...]   # one JSON file per case (default: all)
    python benchmarks/json_identity.py compare A B      # exit 1 on any difference

Run it on the commit before a refactor and on the one after, then compare. The
cases are the speed targets' commands (benchmarks/README.md) and one command per
technique family the CLI exposes; keys that hold wall-clock seconds are dropped
before comparing, as they differ from run to run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TINY = Path(__file__).with_name("tiny-llama-2l.json")

CASES: dict[str, list[str]] = {
    "est-8b-bf16": ["estimate", "--model", "llama-3.1-8b", "--seq-len", "2048", "--precision", "bf16"],
    "est-8b-lora": ["estimate", "--model", "llama-3.1-8b", "--seq-len", "2048", "--lora-rank", "16"],
    "est-8b-gc-fast": ["estimate", "--model", "llama-3.1-8b", "--grad-checkpointing", "--fast"],
    "est-70b-fast": ["estimate", "--model", "llama-3.1-70b", "--precision", "bf16", "--fast"],
    "est-qwen-qlora": ["estimate", "--model", "qwen2.5-7b", "--quantize", "nf4", "--double-quant",
                       "--lora-rank", "16", "--seq-len", "1024"],
    "est-t5": ["estimate", "--model", "t5-base", "--seq-len", "512", "--target-len", "128"],
    "est-varlen": ["estimate", "--model", "llama-3.2-1b", "--seq-lens", "512:2,1024:1,256:3,2048:1"],
    "est-1b-accum": ["estimate", "--model", "llama-3.2-1b", "--seq-len", "1024", "--grad-accum", "4",
                     "--loss", "chunked"],
    "est-config-trl": ["estimate", "--config", "examples/recipes/trl/qwen2_5_0_5b_dpo_lora.yaml"],
    "est-config-tt": ["estimate", "--config", "examples/recipes/torchtune/llama3_2_1b_qlora_single_device.yaml"],
    "est-1b-methods": ["estimate", "--model", "llama-3.2-1b", "--seq-len", "512", "--method", "all",
                       "--gpus", "8", "--grad-checkpointing"],
    "plan-70b": ["plan", "--model", "llama-3.1-70b", "--gpus", "64", "--nodes", "8"],
    "plan-tiny": ["plan", "--model", str(TINY), "--gpus", "2", "--seq-len", "128", "--no-verify"],
    "validate-cpu": ["validate", "tests/fixtures/groundtruth-cpu.jsonl"],
}

_VOLATILE = {"elapsed_s", "seconds", "wall_s", "trace_s", "time_s", "timings"}


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _VOLATILE and not k.endswith("_seconds")}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    if isinstance(x, str) and x.endswith(".json") and "/" in x:
        return Path(x).name  # a config path under the checkout: two checkouts differ only in the prefix
    return x


def run(out: Path, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, argv in CASES.items():
        if only and name not in only:
            continue
        p = subprocess.run([sys.executable, "-m", "llmem_plugin.cli", *argv, "--gpu", "h100-sxm", "--json"],
                           capture_output=True, text=True)
        (out / f"{name}.json").write_text(json.dumps({"rc": p.returncode, "stdout": p.stdout,
                                                      "stderr_tail": p.stderr[-2000:]}, indent=1))
        print(name, p.returncode, flush=True)


def compare(a: Path, b: Path) -> int:
    bad = 0
    for fa in sorted(a.glob("*.json")):
        fb = b / fa.name
        ra, rb = json.loads(fa.read_text()), json.loads(fb.read_text())
        ja = _strip(json.loads(ra["stdout"])) if ra["stdout"].strip() else ra["stdout"]
        jb = _strip(json.loads(rb["stdout"])) if rb["stdout"].strip() else rb["stdout"]
        same = ra["rc"] == rb["rc"] and ja == jb
        bad += not same
        print(f"{fa.stem:18s} rc {ra['rc']}/{rb['rc']} {'identical' if same else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(Path(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
