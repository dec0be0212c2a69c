"""Framework adapters: the HF Trainer callback, the Lightning strategy, the ColossalAI chooser, DeepSpeed configs.

In: a framework's trainer and model. Out: the plan applied, or a warning once and training goes on.

Importable as ``llmem_plugin.integrations.<framework>``. Each adapter loads its
framework lazily. The core imports only ``lightning.install_import_hook``
(``llmem_plugin/__init__.py``), which registers ``"llmem-auto"`` once Lightning is imported.
"""

__all__: list[str] = []
