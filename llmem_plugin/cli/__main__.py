"""``python -m llmem_plugin.cli``: the ``llmem`` command."""

import sys

from llmem_plugin.cli.app import main

sys.exit(main())
