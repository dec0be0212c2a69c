"""The ``llmem`` command line: one module per command, the terminal tables and the plots.

In: argv. Out: tables or JSON on stdout; exit 0 (fits), 2 (bad input) or 3 (does not fit).
"""

from llmem_plugin.cli.app import main

__all__ = ["main"]
