"""Predicted memory snapshots in PyTorch's format, and their comparison with real ones.

- :mod:`~llmem_plugin.snapshot.predict`: the allocator replay of a traced step as
  ``torch.cuda.memory._snapshot()`` returns a real one;
- :mod:`~llmem_plugin.snapshot.compare`: a predicted and a real snapshot aligned,
  and what differs between them, in one line.
"""

__all__: list[str] = []  # the modules are the API
