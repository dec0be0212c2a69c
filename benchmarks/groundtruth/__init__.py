"""Ground truth for the estimator: real fine-tuning steps, one JSON line per run.

Run from the repository root as ``python -m benchmarks.groundtruth.run``
(``benchmarks`` is a namespace package; see README.md).
"""
