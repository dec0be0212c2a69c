"""Print the config Axolotl 0.19.0's own validation makes of a YAML, as JSON.

Run in a subprocess with axolotl 0.19.0 and addict on PYTHONPATH
(tests/setup.sh installs them to .frameworks/). It does what ``axolotl train``
does before loading the model (cli/config.py ``load_cfg``): plugins first,
then ``validate_config`` against the schema with the GPU's capabilities
(utils/config/__init__.py), here an sm_90 GPU with bf16 and one process. The
dump is ``model_dump(exclude_none=True)``; also printed: the schema's field
names and aliases, for the reader's key list.
"""

import json
import sys

import yaml
from addict import Dict
from axolotl.integrations.base import PluginManager  # noqa: F401 - registers the plugin machinery
from axolotl.utils.config import prepare_plugins, validate_config
from axolotl.utils.schemas.config import AxolotlInputConfig

with open(sys.argv[1], encoding="utf-8") as f:
    cfg = Dict(yaml.safe_load(f))
prepare_plugins(cfg)
caps = {"bf16": True, "fp8": True, "tf32": True, "n_gpu": 1, "compute_capability": "sm_90"}
env = {"torch_version": "2.13.0"}
out = validate_config(cfg, capabilities=caps, env_capabilities=env)
names = set()
for name, field in AxolotlInputConfig.model_fields.items():
    names.add(name)
    if field.alias:
        names.add(field.alias)
print(json.dumps({"cfg": json.loads(json.dumps(dict(out), default=str)), "schema_keys": sorted(names)}))
