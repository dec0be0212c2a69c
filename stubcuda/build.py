"""Build the stub CUDA device: one shared library per CUDA library torch links.

For each library torch's CUDA build needs (read from its own dynamic symbol
tables with ``nm``), this compiles the hand-written stand-in in ``src/`` and
generates a default for every other function torch imports from it: a
function that returns the library's "not supported" status. Each library gets
the soname and symbol-version node torch's binaries ask for, so the dynamic
linker accepts it in place of the real one.

Usage: python stubcuda/build.py --python .stubvenv/bin/python [--out stubcuda/build]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

# soname -> (hand-written source or None, version node or None, default status).
# Default statuses are each library's "not supported" code from its API
# reference; cuBLAS/cuBLASLt answer success so that BLAS calls are no-ops.
LIBRARIES: dict[str, tuple[str | None, str | None, int]] = {
    "libcudart.so.13": ("cudart.c", "libcudart.so.13", 801),       # cudaErrorNotSupported
    "libcuda.so.1": ("driver.c", None, 801),                        # CUDA_ERROR_NOT_SUPPORTED
    "libnvidia-ml.so.1": ("nvml.c", None, 3),                       # NVML_ERROR_NOT_SUPPORTED
    "libcublas.so.13": ("cublas.c", "libcublas.so.13", 0),
    "libcublasLt.so.13": ("cublaslt.c", "libcublasLt.so.13", 0),
    "libcudnn.so.9": ("cudnn.c", "libcudnn.so.9", 3000),            # CUDNN_STATUS_NOT_SUPPORTED
    "libcufft.so.12": (None, "libcufft.so.12", 16),                 # CUFFT_NOT_SUPPORTED
    "libcurand.so.10": (None, "libcurand.so.10", 501),              # CURAND_STATUS_NOT_INITIALIZED... unused
    "libcusolver.so.12": (None, "libcusolver.so.12", 15),           # CUSOLVER_STATUS_NOT_SUPPORTED
    "libcusparse.so.12": (None, "libcusparse.so.12", 10),           # CUSPARSE_STATUS_NOT_SUPPORTED
    "libcusparseLt.so.0": (None, None, 10),
    "libcufile.so.0": (None, None, 5030),                           # CU_FILE_PLATFORM_NOT_SUPPORTED
    "libcupti.so.13": (None, "libcupti.so.13", 1),                  # CUPTI_ERROR_INVALID_PARAMETER
    "libnccl.so.2": ("nccl.c", None, 5),                            # ncclInvalidUsage
    "libnvrtc.so.13": ("nvrtc.c", "libnvrtc.so.13", 11),            # NVRTC_ERROR_INTERNAL_ERROR
    "libnvshmem_host.so.3": (None, "NVSHMEM", 1),
}
# Libraries whose functions call the shared state in libcudart.
LINK_CUDART = {"libcuda.so.1", "libnvidia-ml.so.1"}
# Unversioned imports are assigned by prefix.
_PREFIXES = (
    ("cusparseLt", "libcusparseLt.so.0"),
    ("nccl", "libnccl.so.2"),
    ("cuFile", "libcufile.so.0"),
    ("nvshmem", "libnvshmem_host.so.3"),
    ("nvml", "libnvidia-ml.so.1"),
)
_DRIVER = re.compile(r"^cu[A-Z]")


def torch_dir(python: str) -> Path:
    """Locate torch in ``python``'s environment without importing it."""
    code = "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return Path(out.strip())


def bitsandbytes_dir(python: str) -> Path | None:
    """bitsandbytes' package directory in ``python``'s environment, if it is installed."""
    code = ("import importlib.util as u; s = u.find_spec('bitsandbytes'); "
            "print(s.submodule_search_locations[0] if s else '')")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    return Path(out) if out else None


def imports(torch: Path, extra: Path | None = None) -> dict[str, set[str]]:
    """Function names torch's binaries import, grouped by the soname providing them; with
    ``extra`` (bitsandbytes' package directory), its CUDA libraries' imports too, so that
    they load (their kernels then launch into the stub and compute nothing, as torch's do)."""
    by_lib: dict[str, set[str]] = {name: set() for name in LIBRARIES}
    node_to_lib = {node: lib for lib, (_, node, _) in LIBRARIES.items() if node}
    binaries = sorted(torch.glob("lib/*.so")) + sorted(torch.glob("_C*.so"))
    if extra is not None:
        binaries += sorted(extra.glob("libbitsandbytes_cuda*.so"))
    for binary in binaries:
        out = subprocess.run(["nm", "-D", "--undefined-only", "--with-symbol-versions", str(binary)],
                             check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            sym = line.split()[-1]
            name, _, version = sym.partition("@")
            if version:
                lib = node_to_lib.get(version)
            else:
                lib = next((l for p, l in _PREFIXES if name.startswith(p)), None)
                if lib is None and _DRIVER.match(name):
                    lib = "libcuda.so.1"
            if lib:
                by_lib[lib].add(name)
    return by_lib


def defined(obj: Path) -> set[str]:
    out = subprocess.run(["nm", "--defined-only", "-g", str(obj)], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def build(python: str, out: Path) -> dict:
    torch = torch_dir(python)
    out.mkdir(parents=True, exist_ok=True)
    needed = imports(torch, bitsandbytes_dir(python))
    summary = {}
    # libcudart first: the others link against it.
    for soname in sorted(LIBRARIES, key=lambda s: s != "libcudart.so.13"):
        source, node, status = LIBRARIES[soname]
        objs = []
        hand: set[str] = set()
        if source:
            obj = out / f"{soname}.hand.o"
            subprocess.run(["gcc", "-O2", "-fPIC", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-c", str(SRC / source), "-I", str(SRC), "-o", str(obj)], check=True)
            objs.append(obj)
            hand = defined(obj)
        missing = sorted(needed[soname] - hand)
        gen = out / f"{soname}.gen.c"
        gen.write_text(
            f"/* Generated by stubcuda/build.py from torch's imports: {len(missing)} functions of\n"
            f" * {soname} that the stand-in does not implement; each returns {status}. */\n"
            + "".join(f"int {name}(void) {{ return {status}; }}\n" for name in missing))
        objs.append(gen)
        cmd = ["gcc", "-O2", "-fPIC", "-shared", f"-Wl,-soname,{soname}", "-o", str(out / soname)]
        if node:
            script = out / f"{soname}.map"
            script.write_text(f"{node} {{ global: *; }};\n")
            cmd.append(f"-Wl,--version-script={script}")
        cmd += [str(o) for o in objs]
        if soname in LINK_CUDART:
            cmd += [f"-L{out}", "-l:libcudart.so.13", "-Wl,-rpath,$ORIGIN"]
        cmd += ["-ldl", "-lpthread"]
        subprocess.run(cmd, check=True)
        summary[soname] = {"hand_written": len(hand), "generated": len(missing)}
    (out / "manifest.json").write_text(json.dumps({"torch": str(torch), "libraries": summary}, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter of the environment with torch's CUDA build")
    ap.add_argument("--out", type=Path, default=HERE / "build")
    args = ap.parse_args(argv)
    for soname, counts in build(args.python, args.out).items():
        print(f"{soname:24s} {counts['hand_written']:4d} written {counts['generated']:4d} generated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
