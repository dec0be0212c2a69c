"""`llmem estimate --help` groups the options by what they change."""

from __future__ import annotations

from llmem_plugin.cli.app import main


def _sections(text: str) -> dict[str, str]:
    out, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            out[title] = ""
        elif title:
            out[title] += line + "\n"
    return out


def _assert_groups(sections: dict[str, str], expected: dict[str, list[str]]) -> None:
    for title, flags in expected.items():
        assert title in sections, sorted(sections)
        for flag in flags:
            assert flag in sections[title], (title, flag)


def test_estimate_help_groups_the_recipe_options(capsys):
    assert main(["estimate", "--help"]) == 0
    sections = _sections(capsys.readouterr().out)
    expected = {
        "loss path": ["--loss ", "--loss-chunks", "--loss-chunk-upcast", "--logits-to-keep", "no-upcast"],
        "activation checkpointing": ["--grad-checkpointing", "--checkpoint-every"],
        "QLoRA": ["--quantize", "--double-quant", "--kbit-prepare"],
        "LoRA": ["--lora-rank", "--lora-targets"],
        "distributed method": ["--method", "--gpus", "--tp"],
    }
    _assert_groups(sections, expected)
    # Each option is listed once, in its group only.
    assert "--loss " not in sections["options"] and "--quantize" not in sections["options"]


def test_plan_help_groups_its_options(capsys):
    assert main(["plan", "--help"]) == 0
    sections = _sections(capsys.readouterr().out)
    expected = {
        "model and batch": ["--model", "--seq-len", "--global-batch"],
        "cluster": ["--gpus", "--nodes", "--host-memory"],
        "GPU and environment": ["--gpu ", "--gpu-memory"],
        "search": ["--margin", "--methods", "--tp", "--micro-batch", "--grad-checkpointing", "--no-verify"],
        "allocator": ["--alloc-conf"],
        "step-time model": ["--efficiency", "--inter-node-gbps"],
        "output": ["--all", "--plot", "--json"],
    }
    _assert_groups(sections, expected)
    assert "--model" not in sections["options"] and "--margin" not in sections["options"]
