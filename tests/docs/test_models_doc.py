"""docs/models.md lists every modelled task and the catalog's non-causal entries, as the code has them."""

from __future__ import annotations

from pathlib import Path

from llmem_plugin.models import catalog
from llmem_plugin.models.tasks import config_task
from llmem_plugin.workload import Task

DOC = (Path(__file__).parents[2] / "docs" / "models.md").read_text()


def test_every_task_has_a_row_and_a_test_that_exists():
    rows = [line for line in DOC.splitlines() if line.startswith("| `")]
    assert sorted(r.split("`")[1] for r in rows) == sorted(t.value for t in Task)
    root = Path(__file__).parents[2]
    for row in rows:
        for cited in (w.strip("`();,") for w in row.split() if w.strip("`();,").startswith("tests/")):
            assert (root / cited).exists(), cited


def test_catalog_entries_that_are_not_causal_lms_are_named_with_their_task():
    for name in catalog.names():
        task = config_task(catalog.load_config(name))
        if task is not Task.CAUSAL_LM:
            assert f"`{name}`" in DOC and task.value in DOC.split(f"`{name}`", 1)[1][:120], name
