"""Time of the composition's stand-in search (methods/pp_compose.virtual_pipeline) for every rank of a
pipeline, per schedule, with the machine and versions.

    python benchmarks/pp_search.py > benchmarks/results/pp-search-<date>.json
"""

from __future__ import annotations

import json
import os
import platform
import time

CASES = [("1f1b", 16, 64, 1), ("interleaved-1f1b", 8, 32, 2), ("interleaved-1f1b", 16, 64, 2), ("zbv", 8, 32, 2)]


def main() -> None:
    import torch

    from llmem_plugin.methods.pp import compose as pp_compose

    rows = []
    for schedule, p, m, v in CASES:
        for cache in (pp_compose._actions_of, pp_compose._keys_of):
            cache.cache_clear()  # each case from a cold cache
        t = time.perf_counter()
        stand_ins = [pp_compose.virtual_pipeline(schedule, p, m, v, r) for r in range(p)]
        rows.append({"schedule": schedule, "pp": p, "microbatches": m, "stages_per_rank": v,
                     "seconds": round(time.perf_counter() - t, 2),
                     "distinct_stand_ins": len({s for s in stand_ins if s is not None}),
                     "ranks_traced_whole": sum(s is None for s in stand_ins),
                     "stand_in_microbatches": sorted({x for s in stand_ins if s is not None for x in s.microbatches})})
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
                      "python": platform.python_version(), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
