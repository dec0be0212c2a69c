"""A fixed corpus of bad and odd ``llmem`` invocations, run in-process.

Every case runs through :func:`llmem_plugin.cli.app.main` and must end with its
expected exit code, never with a traceback: bad input exits 2 with one line
on stderr that ends with a HINT (and names the value where the case says
which), before anything is traced. Each case must finish within
``_CASE_LIMIT_S``; a SIGALRM stops a case that runs past it.
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time

import pytest

from llmem_plugin.cli import app as cli

_CASE_LIMIT_S = 20  # refused input takes milliseconds; the tiny model's trace a few seconds

# A tiny Llama: 2 layers of width 64, so accepted cases trace in about a second.
_TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
}
TINY = "@tiny"  # placeholder for the tiny config's path
E, P = ["estimate", "--model", TINY, "--seq-len", "32"], ["plan", "--model", TINY, "--seq-len", "32"]


def _case(argv, code=2, expect=None, id=None):
    return pytest.param(list(argv), code, expect, id=id or " ".join(map(str, argv))[:120])


_BAD_INTS = ["0", "-1", "-7", "abc", "1.5", "1e3", "nan", "inf", "-inf", "99999999999999999999", "", "0x10", " ",
             "9" * 5000, "2**10", "+-3"]
_BAD_FLOATS = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "abc", "1e309", "", "1,5"]


def _int_cases():
    cases = []
    for flag in ("--seq-len", "--batch-size", "--grad-accum", "--loss-chunks", "--lora-rank", "--gpus", "--nodes",
                 "--tp", "--target-len", "--images"):
        for v in _BAD_INTS:
            cases.append(_case([*E, flag, v], expect=flag))
    for v in [v for v in _BAD_INTS if v != "0"]:
        cases.append(_case([*E, "--logits-to-keep", v], expect="--logits-to-keep"))
    for flag in ("--seq-len", "--gpus", "--nodes", "--global-batch", "--micro-batch", "--loss-chunks", "--lora-rank"):
        for v in ("0", "-1", "abc", "1.5", "99999999999999999999", "nan", "inf"):
            cases.append(_case([*P, flag, v], expect=flag))
    for flag in ("--batch-size", "--grad-accum"):  # within int64, above the stated bound
        cases.append(_case([*E, flag, "1000000"], expect=flag))
    cases.append(_case([*E, "--seq-len", "16777216", "--batch-size", "2"], expect="--seq-len"))
    return cases


def _float_cases():
    cases = []
    for flag, extra in (("--lora-alpha", ["0"]), ("--lora-dropout", ["1", "1.5"])):
        for v in [*_BAD_FLOATS, *extra]:
            cases.append(_case([*E, "--lora-rank", "4", flag, v], expect=flag))
    for flag, extra in (("--margin", ["1", "2"]), ("--efficiency", ["0", "1.5"]), ("--inter-node-gbps", ["0"])):
        for v in [*_BAD_FLOATS, *extra]:
            cases.append(_case([*P, flag, v], expect=flag))
    return cases


def _choice_cases():
    bad = {
        "--precision": ["fp8", "bf32", "", "BF16-MIXED-X", "bf16-true-ish"],
        "--optimizer": ["lion", "adam", "", "adamw-8bit-x"],
        "--attn": ["flash3", "", "xformers"],
        "--quantize": ["nf3", "int4", ""],
        "--loss": ["foo", "", "mse"],
        "--offload-activations": ["disk", "gpu"],
        "--alloc-conf": ["expandable_segments:maybe", "max_split_size_mb:-1", "garbage_collection_threshold:2",
                         "roundup_power2_divisions:abc", "no_such_key:1", ":::"],
    }
    cases = []
    for flag, values in bad.items():
        for v in values:
            cases.append(_case([*E, flag, v], expect=flag if flag != "--alloc-conf" else None))
    for v in ("gpu", "both"):
        cases.append(_case([*E, "--gpus", "2", "--offload", v], expect="--offload"))
    for v in ("sometimes", "yes"):
        cases.append(_case([*P, "--grad-checkpointing", v], expect="--grad-checkpointing"))
    for v in ("nosuch", "single,nosuch", ",", ""):
        cases.append(_case([*P, "--methods", v]))
    for v in ("a", "2,b", "0", "-2", "99999999999999999999", ",", ""):
        cases.append(_case([*P, "--tp", v], expect="--tp" if v not in (",", "") else None))
    for v in ("nosuch", "", "help2"):
        cases.append(_case([*E, "--method", v, "--gpus", "2"]))
    return cases


# Malformed configs: (file name, content). Content is a dict (JSON-dumped),
# or bytes written as they are.
def _with(**fields):
    return {**_TINY, **fields}


def _without(*names):
    return {k: v for k, v in _TINY.items() if k not in names}


_CONFIGS = {
    "neg_hidden": (_with(hidden_size=-64), "hidden_size"),
    "zero_hidden": (_with(hidden_size=0), "hidden_size"),
    "float_hidden": (_with(hidden_size=64.5), "hidden_size"),
    "float_int_hidden": (_with(hidden_size=64.0), "hidden_size"),
    "str_hidden": (_with(hidden_size="64"), "hidden_size"),
    "null_hidden": (_with(hidden_size=None), "hidden_size"),
    "bool_hidden": (_with(hidden_size=True), "hidden_size"),
    "list_hidden": (_with(hidden_size=[64]), "hidden_size"),
    "dict_hidden": (_with(hidden_size={"a": 1}), "hidden_size"),
    "inf_hidden": (b'{"model_type": "llama", "hidden_size": Infinity, "num_hidden_layers": 2, '
                   b'"num_attention_heads": 4, "vocab_size": 256}', "hidden_size"),
    "nan_hidden": (b'{"model_type": "llama", "hidden_size": NaN, "num_hidden_layers": 2, '
                   b'"num_attention_heads": 4, "vocab_size": 256}', "hidden_size"),
    "tagged_inf_hidden": (_with(hidden_size={"__float__": "Infinity"}), "hidden_size"),
    "huge_hidden": (_with(hidden_size=10**30), "hidden_size"),
    "big_hidden": (_with(hidden_size=2**40), "hidden_size"),
    "str_layers": (_with(num_hidden_layers="2"), "num_hidden_layers"),
    "neg_layers": (_with(num_hidden_layers=-2), "num_hidden_layers"),
    "zero_layers": (_with(num_hidden_layers=0), "num_hidden_layers"),
    "huge_layers": (_with(num_hidden_layers=10**9), "num_hidden_layers"),
    "many_layers": (_with(num_hidden_layers=100000), "num_hidden_layers"),
    "float_layers": (_with(num_hidden_layers=2.5), "num_hidden_layers"),
    "heads_not_dividing": (_with(num_attention_heads=5, num_key_value_heads=5), "num_attention_heads"),
    "zero_heads": (_with(num_attention_heads=0), "num_attention_heads"),
    "neg_heads": (_with(num_attention_heads=-4), "num_attention_heads"),
    "zero_kv_heads": (_with(num_key_value_heads=0), "num_key_value_heads"),
    "kv_not_dividing": (_with(num_key_value_heads=3), "num_key_value_heads"),
    "kv_above_heads": (_with(num_key_value_heads=8), "num_key_value_heads"),
    "zero_vocab": (_with(vocab_size=0), "vocab_size"),
    "huge_vocab": (_with(vocab_size=10**12), "vocab_size"),
    "neg_intermediate": (_with(intermediate_size=-1), "intermediate_size"),
    "str_intermediate": (_with(intermediate_size="big"), "intermediate_size"),
    "zero_head_dim": (_with(head_dim=0), "head_dim"),
    "bad_dtype": (_with(torch_dtype="float33"), "torch_dtype"),
    "int_dtype": (_with(torch_dtype=5), "torch_dtype"),
    "device_dtype": (_with(dtype="cuda"), "dtype"),
    "only_model_type": ({"model_type": "llama"}, "hidden_size"),
    "no_layers": (_without("num_hidden_layers"), "num_hidden_layers"),
    "no_vocab": (_without("vocab_size"), "vocab_size"),
    "no_heads": (_without("num_attention_heads"), "num_attention_heads"),
    "no_model_type": (_without("model_type"), "model_type"),
    "unknown_model_type": (_with(model_type="no-such-arch"), "no-such-arch"),
    "int_model_type": (_with(model_type=5), "model_type"),
    "list_model_type": (_with(model_type=["llama"]), "model_type"),
    "json_array": ([_TINY], "model_type"),
    "json_string": ("llama", "model_type"),
    "json_null": (None, "model_type"),
    "empty_file": (b"", None),
    "not_json": (b"hidden_size = 64\n", None),
    "truncated": (json.dumps(_TINY)[:-5].encode(), None),
    "nul_bytes": (b'{"model_type": "llama"\x00\x00}', None),
    "binary": (bytes(range(256)), None),
    "latin1": ('{"model_type": "llamä"}'.encode("latin-1"), None),
    "deep_nested": (b'{"model_type": "llama", "x": ' + b"[" * 200000 + b"]" * 200000 + b"}", None),
    "deep_nested_dict": (b'{"model_type": "llama", "rope_scaling": ' + b'{"a": ' * 100000 + b"1"
                         + b"}" * 100000 + b"}", None),
    "moe_zero_experts_neg": (_with(model_type="mixtral", num_local_experts=-1), "num_local_experts"),
    "moe_str_experts": (_with(model_type="qwen3_moe", num_experts="8"), "num_experts"),
    "gpt2_neg_embd": ({"model_type": "gpt2", "n_embd": -1, "n_layer": 2, "n_head": 2, "vocab_size": 256},
                      "n_embd"),
    "gpt2_no_layers": ({"model_type": "gpt2", "n_embd": 64, "n_head": 2, "vocab_size": 256}, "num_hidden_layers"),
}


def _config_cases():
    cases = []
    for name, (_, field) in _CONFIGS.items():
        for cmd in (["estimate", "--fast"], ["estimate"], ["plan", "--no-verify", "--gpus", "1"]):
            cases.append(_case([cmd[0], "--model", f"@cfg:{name}", "--seq-len", "32", *cmd[1:]], expect=field,
                               id=f"config {name} {' '.join(cmd)}"))
    return cases


def _model_name_cases():
    names = ["", " ", "nonexistent-model", "llama-9.9-1t", "a/b/c", "../../etc/passwd", "/nonexistent/config.json",
             "nonexistent_dir/", "meta-llama/NoSuchModel", "llama\x00-3", "x" * 5000, "🦙", "-", "opt-125m/",
             "@dir_without_config", "@cfg_dir_empty_name/"]
    cases = []
    for n in names:
        cases.append(_case(["estimate", "--model", n, "--seq-len", "32"], expect=None, id=f"model {n[:40]!r} estimate"))
        cases.append(_case(["plan", "--model", n, "--gpus", "1", "--no-verify"], expect=None,
                           id=f"model {n[:40]!r} plan"))
    return cases


# GPU names: (name, code, text the output holds).
_GPU_NAMES = [
    ("H100", 2, "h100-sxm"), ("h100", 2, "h100-pcie"), ("h100-80gb", 2, "h100-sxm"), ("A100", 2, "a100-80gb"),
    ("V100", 2, "v100-32gb"), ("80GB", 2, "h100-sxm"),
    ("A100 40GB", 0, "a100-40gb"), ("a100-40g", 0, "a100-40gb"), ("a100 80gb", 0, "a100-80gb"),
    ("RTX 4090", 0, "rtx-4090"), ("4090", 0, "rtx-4090"), ("rtx4090", 0, "rtx-4090"),
    ("GeForce RTX 3090", 0, "rtx-3090"), ("NVIDIA H100 80GB HBM3", 0, "h100-sxm"), ("h100 sxm", 0, "h100-sxm"),
    ("H100 PCIe", 0, "h100-pcie"), ("nvidia l4", 0, "l4"), ("H200", 0, "h200"), ("A10G", 0, "a10g"),
    ("", 2, None), (" ", 2, None), ("xyz", 2, "xyz"), ("tpu-v4", 2, "tpu-v4"), ("nvidia", 2, None),
    ("h100\x00", 2, None), ("a" * 1000, 2, None), ("-1", 2, None), ("rtx", 2, "rtx-3090"), ("5090", 2, "5090"),
]


def _gpu_cases():
    cases = []
    for name, code, text in _GPU_NAMES:
        cases.append(_case(["gpus", name, "--json"], code, text, id=f"gpus {name[:40]!r}"))
        if code:
            cases.append(_case([*E, "--gpu", name], 2, text, id=f"estimate --gpu {name[:40]!r}"))
            cases.append(_case([*P, "--gpu", name, "--gpus", "1"], 2, text, id=f"plan --gpu {name[:40]!r}"))
    for mem in ("abc", "-1", "0", "0GiB", "80XB", "1e3GiB", "nan", "inf", "99999999999999999999GiB", "", "80 G iB",
                "0.0000001MiB"):
        cases.append(_case([*E, "--gpu-memory", mem], 2, "--gpu-memory", id=f"estimate --gpu-memory {mem!r}"))
        cases.append(_case(["gpus", "h100-sxm", "--gpu-memory", mem], 2, "--gpu-memory", id=f"gpus --gpu-memory {mem!r}"))
    return cases


def _contradiction_cases():
    return [
        _case([*E, "--quantize", "nf4"], expect="--lora-rank"),
        _case([*E, "--double-quant"], expect="--double-quant"),
        _case([*E, "--double-quant", "--quantize", "int8", "--lora-rank", "4"], expect="--double-quant"),
        _case([*E, "--loss-chunks", "4"], expect="--loss-chunks"),
        _case([*E, "--loss", "liger", "--loss-chunks", "4"], expect="--loss-chunks"),
        _case([*E, "--lora-alpha", "16"], expect="--lora-alpha"),
        _case([*E, "--lora-dropout", "0.1"], expect="--lora-dropout"),
        _case([*E, "--lora-targets", "q_proj"], expect="--lora-targets"),
        _case([*E, "--lora-rank", "4", "--lora-targets", ""], expect="--lora-targets"),
        _case([*E, "--lora-rank", "4", "--lora-targets", ",,"], expect="--lora-targets"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "no_such_proj"], expect="no_such_proj"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "q_proj;v_proj"], expect="--lora-targets"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "embed_tokens"], expect="embed_tokens"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "q_proj,embed_tokens"], expect="embed_tokens"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "model"], expect="LlamaModel"),
        _case([*E, "--lora-rank", "4", "--lora-targets", "layers"], expect="ModuleList"),
        _case([*E, "--logits-to-keep", "100"], expect="logits_to_keep"),
        _case([*E, "--sequence-parallel"], expect="--sequence-parallel"),
        # Tasks (llmem_plugin.models.tasks): a bad name, a task the model type has no class for, options of another task.
        _case([*E, "--task", "classification"], expect="classification"),
        _case([*E, "--task", ""], expect="task"),
        _case([*E, "--task", "seq2seq"], expect="seq2seq"),
        _case([*E, "--task", "image-text-to-text"], expect="image-text-to-text"),
        _case([*E, "--target-len", "8"], expect="--target-len"),
        _case([*E, "--images", "2"], expect="--images"),
        _case([*E, "--freeze-vision"], expect="--freeze-vision"),
        _case([*E, "--task", "seq-cls", "--reference-model"], expect="reference"),
        _case([*E, "--task", "seq-cls", "--gpus", "2"], expect="one GPU only"),
        _case(["plan", "--model", "distilbert-sst2", "--gpus", "2", "--gpu", "h100-sxm"], expect="one GPU only"),
        _case([*E, "--plot", "x.png", "--fast", "--method", "all"], expect="--plot"),
        _case([*E, "--plot", "x.png", "--gpus", "2"], expect="--plot"),
        _case([*E, "--plot", "/nonexistent_dir/x.png"], expect="/nonexistent_dir"),
        _case([*E, "--plot", "x.txt"], expect="x.txt"),
        _case([*E, "--plot", "/"], expect="--plot"),
        _case([*E, "--plot", "a\x00.png"], expect="--plot"),
        _case([*P, "--plot", "/nonexistent_dir/x.png"], expect="/nonexistent_dir"),
        _case([*E, "--offload", "optimizer", "--method", "ddp", "--gpus", "2"], expect="--offload"),
        _case([*E, "--method", "tp", "--tp", "3", "--gpus", "4"], expect="--tp"),
        _case([*E, "--nodes", "2", "--gpus", "3"], expect="--nodes"),
        _case([*E, "--gpus", "128"], expect="--nodes"),  # 128 GPUs on one node
        _case([*E, "--gpus", "65536", "--nodes", "2"], expect="--nodes"),
        _case([*E, "--gpus", "1048576", "--nodes", "16384"], expect="--gpus"),
        _case([*P, "--gpus", "4096"], expect="--nodes"),
        _case([*E, "--nodes", "4", "--gpus", "2"], expect="--nodes"),
        _case([*E, "--tp", "2"], expect="--tp"),
        _case([*E, "--tp", "4", "--gpus", "2"], expect="--tp"),
        _case([*E, "--method", "single", "--gpus", "2"], expect="single"),
        _case([*E, "--method", "tp", "--gpus", "2", "--tp", "1"], expect="--tp"),
        _case([*E, "--sequence-parallel", "--method", "ddp", "--gpus", "2"], expect="--sequence-parallel"),
        _case([*E, "--torch-version", "abc"], expect="abc"),
        _case([*E, "--torch-version", "-1"], expect="-1"),
        _case([*E, "--torch-version", "2.1.0"], expect="2.1.0"),
        _case([*E, "--torch-version", "3.0"], expect="3.0"),
        _case([*E, "--torch-version", "2"], expect="'2'"),
        _case([*E, "--torch-version", ""], expect="--torch-version"),
        _case([*E, "--torch-version", "99999999999999999999.1"], expect="--torch-version"),
        _case([*P, "--micro-batch", "4", "--global-batch", "2", "--gpus", "1"], expect="--global-batch"),
        _case([*P, "--tp", "3", "--gpus", "4"], expect="--tp"),
        _case([*P, "--nodes", "3", "--gpus", "4"], expect="--nodes"),
        _case([*P, "--quantize", "nf4"], expect="--lora-rank"),
        _case([*P, "--loss-chunks", "4"], expect="--loss-chunks"),
        _case([*P, "--lora-alpha", "8"], expect="--lora-alpha"),
        _case([*P, "--torch-version", "2.1.0"], code=2),  # plan has no --torch-version
        _case(["estimate"], expect="--model"),
        _case(["plan"], expect="--model"),
        _case([], expect="command"),
        _case(["nosuch"], expect="nosuch"),
        _case(["--version"], code=0, expect="llmem"),
        _case([*E, "--no-such-flag"], expect="--no-such-flag"),
        _case([*E, "--seq-len"], expect="--seq-len"),
        _case([*E, "extra"], expect="extra"),
        _case(["gpus", "--gpu"], expect="--gpu"),
        _case(["validate"], expect="FILE"),
        _case(["models", "--gpu", "nosuch"], expect="nosuch"),
    ]


def _validate_cases():
    return [_case(["validate", f"@val:{name}"], expect=expect, id=f"validate {name}") for name, (_, expect) in
            _VALIDATE_FILES.items() if name != "one_row"] + [
        _case(["validate", "/nonexistent/rows.jsonl"], expect="/nonexistent/rows.jsonl"),
        _case(["validate", "@dir"], expect=None),
        _case(["validate", "rows\x00.jsonl"], expect=None),
        _case(["validate", "@val:one_row", "--gpu", "nosuch"], expect="nosuch"),
    ]


_ROW = {"id": "r1", "model": "opt-125m", "workload": {"seq_len": 32}, "status": "ok",
        "measured": {"allocated_bytes": 1}, "device": "cpu"}
_VALIDATE_FILES = {
    "nul_bytes": (b"\x00\x00\x00\n\x00", None),
    "not_rows_object": (b'{"a": 1}\n', "id"),
    "not_rows_array": (b"[1, 2, 3]\n", None),
    "not_rows_string": (b'"row"\n', None),
    "not_rows_number": (b"5\n", None),
    "json_document": (json.dumps({"rows": [_ROW]}, indent=2).encode(), None),
    "empty": (b"", None),
    "blank_lines": (b"\n\n  \n", None),
    "binary": (bytes(range(256)), None),
    "truncated": (json.dumps(_ROW)[:-3].encode(), None),
    "deep_nested": (b"[" * 200000 + b"]" * 200000, None),
    "row_bad_workload_type": (json.dumps({**_ROW, "workload": "big"}).encode(), None),
    "row_bad_workload_key": (json.dumps({**_ROW, "workload": {"no_such": 1}}).encode(), None),
    "row_bad_seq_len": (json.dumps({**_ROW, "workload": {"seq_len": -1}}).encode(), None),
    "row_bad_lora": (json.dumps({**_ROW, "workload": {"lora": {"rank": "x"}}}).encode(), None),
    "row_measured_not_dict": (json.dumps({**_ROW, "measured": 5}).encode(), None),
    "row_device_not_str": (json.dumps({**_ROW, "device": {"name": "cpu"}}).encode(), "device"),
    "row_bad_status": (json.dumps({**_ROW, "status": "great"}).encode(), "status"),
    "row_id_not_str": (json.dumps({**_ROW, "id": 5}).encode(), "id"),
}
_VALIDATE_FILES["one_row"] = (json.dumps(_ROW).encode(), None)


CORPUS = (_int_cases() + _float_cases() + _choice_cases() + _config_cases() + _model_name_cases() + _gpu_cases()
          + _contradiction_cases() + _validate_cases())


def test_corpus_size():
    assert len(CORPUS) >= 500


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    tiny = root / "tiny.json"
    tiny.write_text(json.dumps(_TINY))
    out[TINY] = str(tiny)
    for name, (content, _) in {**{f"cfg:{k}": v for k, v in _CONFIGS.items()},
                               **{f"val:{k}": v for k, v in _VALIDATE_FILES.items()}}.items():
        path = root / (name.replace(":", "_") + (".jsonl" if name.startswith("val:") else ".json"))
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        out["@" + name] = str(path)
    (root / "empty_dir").mkdir()
    out["@dir_without_config"] = out["@dir"] = str(root / "empty_dir")
    out["@cfg_dir_empty_name/"] = str(root) + "/"
    return out


class _Timeout(Exception):
    pass


def run_in_process(argv):
    """(exit code, stdout, stderr, seconds) of ``cli.main(argv)``; exceptions propagate."""
    out, err = io.StringIO(), io.StringIO()

    def on_alarm(signum, frame):
        raise _Timeout(f"ran past {_CASE_LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(_CASE_LIMIT_S)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, out.getvalue(), err.getvalue(), time.perf_counter() - start


@pytest.mark.parametrize(("argv", "code", "expect"), CORPUS)
def test_fuzz_case(argv, code, expect, files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative --plot files land here
    argv = [files.get(a, a) for a in argv]
    got, out, err, _ = run_in_process(argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert got == code, f"exit {got}, expected {code}; stderr: {err[-2000:]}"
    if code == 2:
        assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {err[-2000:]}"
        assert "HINT" in lines[0], lines[0]
    if expect is not None:
        assert expect.lower() in (out + err).lower(), f"{expect!r} not named in: {(out + err)[-2000:]}"
