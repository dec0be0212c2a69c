"""Framework adapters (HF Trainer, Lightning, ColossalAI, DeepSpeed).

Importable as ``llmem_plugin.integrations.<framework>``. Each adapter loads its
framework lazily; the core never imports this package.
"""

__all__: list[str] = []
