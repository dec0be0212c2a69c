"""`--host-memory` in `llmem plan` and `llmem estimate`: the node's host RAM,
its catalog default printed with its source, and exit 3 when the host does not fit."""

from __future__ import annotations

import json

import pytest
import transformers

from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT
from llmem_plugin.device.host import process_baseline_bytes

from ._run import run

GIB = 2**30


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    ).save_pretrained(d)
    return str(d / "config.json")




def test_plan_refuses_offload_over_the_node_ram_with_exit_3(capsys, model):
    # The decision (70B on one A10G picks ZeRO-3 offload, about 1.4 TB
    # of host RAM) on a tiny model: two processes' baseline alone exceeds 3 GiB.
    code, out, err = run(capsys, "plan", "--model", model, "--gpus", "2", "--gpu", "a10g", "--seq-len", "64",
                         "--methods", "zero3-offload", "--host-memory", "3GiB")
    assert code == EXIT_WONT_FIT, err
    assert "host memory" in err and "--host-memory" in err
    assert "host RAM per node" in out and "--host-memory" in out


def test_plan_with_enough_host_ram_picks_offload_and_shows_host_per_node(capsys, model):
    pinned = ("--global-batch", "2", "--micro-batch", "1", "--grad-checkpointing", "off")  # one candidate
    code, out, err = run(capsys, "plan", "--model", model, "--gpus", "2", "--gpu", "a10g", "--seq-len", "64",
                         "--methods", "zero3-offload", "--host-memory", "64GiB", "--json", *pinned)
    assert code == 0, err
    d = json.loads(out)
    c = d["choice"]
    assert c["method"] == "zero3-offload" and c["host_fits"]
    assert d["host_memory"] == {"node_bytes": 64 * GIB, "source": "--host-memory"}
    # Two processes, each with its baseline and its offloaded states.
    assert c["host_bytes_per_node"] > 2 * process_baseline_bytes()
    code, out, err = run(capsys, "plan", "--model", model, "--gpus", "2", "--gpu", "a10g", "--seq-len", "64",
                         "--methods", "zero3-offload", "--host-memory", "64GiB", *pinned)
    assert code == 0, err
    assert "host memory of the choice" in out and "per node" in out


def test_estimate_prints_the_catalog_host_default_and_refuses_a_small_node(capsys, model):
    code, out, err = run(capsys, "estimate", "--model", model, "--seq-len", "64", "--gpu", "a10g")
    assert code == 0, err
    assert "host (CPU) RAM of the process" in out and "g5.xlarge" in out
    code, out, err = run(capsys, "estimate", "--model", model, "--seq-len", "64", "--gpu", "a10g",
                         "--host-memory", "1GiB", "--json")
    assert code == EXIT_WONT_FIT
    d = json.loads(out)
    assert d["host_capacity_bytes"] == GIB and not d["host_fits"] and d["host_bytes"] >= process_baseline_bytes()
    assert "host memory does not fit" in err and "HINT" in err


def test_methods_rows_show_host_per_node_and_refuse_a_small_node(capsys, model):
    code, out, err = run(capsys, "estimate", "--model", model, "--seq-len", "64", "--method", "ddp", "--gpus", "2",
                         "--gpu", "a10g", "--host-memory", "3GiB")
    assert code == EXIT_WONT_FIT
    assert "ddp: host (CPU) RAM" in out and "per node" in out and "does NOT fit" in out
    assert "host memory does not fit" in err


@pytest.mark.parametrize("bad", ["lots", "-5GiB", "0"])
def test_bad_host_memory_is_exit_2_with_a_hint(capsys, model, bad):
    code, out, err = run(capsys, "estimate", "--model", model, "--seq-len", "64", f"--host-memory={bad}")
    assert code == EXIT_BAD_INPUT
    assert "host memory" in err and "HINT" in err and "Traceback" not in err
