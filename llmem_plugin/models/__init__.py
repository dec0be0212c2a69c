"""Models: the catalog of configs and the model built from one, with no weights.

In: a model name, config, path or module. Out: an ``nn.Module`` on the meta device, its task, layer kinds and parameter counts; a new model family goes in ``catalog/`` and ``tasks.py``.
"""
