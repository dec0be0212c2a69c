"""The stub CUDA device: test tooling that runs PyTorch's CUDA build with no GPU.

See ``stubcuda/README.md``. :mod:`stubcuda.runner` starts Python processes on
it from the project's tests and benchmarks.
"""
