"""``llmem compare``: a predicted memory snapshot against a real run's, and why they differ."""

from __future__ import annotations

import argparse
import json

__all__ = ["compare_command", "compare_parser", "render_comparison"]

_GROUPS_SHOWN = 5


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid --threshold {text!r}: a fraction such as 0.01") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"--threshold {text} is outside (0, 1): a fraction of the peak, such as 0.01")
    return value


def compare_parser(sub) -> None:
    """``llmem compare PRED REAL``."""
    p = sub.add_parser("compare", help="set a predicted snapshot against a real one: peaks, where they part, why")
    p.add_argument("predicted", metavar="PRED", help="the predicted snapshot (`llmem estimate ... --snapshot PRED`)")
    p.add_argument("real", metavar="REAL",
                   help="the real run's snapshot (torch.cuda.memory._dump_snapshot after "
                        "_record_memory_history, or what the adapters write on OOM)")
    p.add_argument("--threshold", type=_fraction, default=0.01,
                   help="allocated bytes apart, as a fraction of the peak, that count as diverged (default 0.01; "
                        "at least 1 MiB)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=compare_command)


def compare_command(args: argparse.Namespace) -> int:
    """Load both snapshots, compare them and print the report (0: compared, whatever it found)."""
    from llmem_plugin.snapshot.compare import compare_snapshots
    from llmem_plugin.snapshot.history import load_snapshot

    result = compare_snapshots(load_snapshot(args.predicted), load_snapshot(args.real), threshold=args.threshold)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    from rich.console import Console

    render_comparison(result, Console())
    return 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.2f} MiB"


def render_comparison(c, console) -> None:
    """The comparison as a peaks table, the divergence, the live-only groups and the one-line meaning."""
    from rich.table import Table

    t = Table(title="predicted vs real", title_justify="left")
    for col in ("", "predicted", "real", "error"):
        t.add_column(col, justify="right" if col else "left")
    for name, p, r in (("peak allocated", c.predicted_peak_allocated_bytes, c.real_peak_allocated_bytes),
                       ("peak reserved", c.predicted_peak_reserved_bytes, c.real_peak_reserved_bytes)):
        err = f"{(p - r) / r:+.2%}" if r else "-"
        t.add_row(name, _mib(p), _mib(r), err)
    console.print(t)
    console.print(f"aligned {c.num_matched_tokens} of {c.num_predicted_tokens} predicted and {c.num_real_tokens} "
                  "real allocations and frees")
    d = c.divergence
    if d is None:
        console.print(f"no aligned point is more than {_mib(c.threshold_bytes)} apart")
    else:
        console.print(f"first divergence: predicted entry {d.predicted_entry} ({_mib(d.predicted_bytes)} allocated) vs "
                      f"real entry {d.real_entry} ({_mib(d.real_bytes)}), near {d.near}", markup=False)
    for title, groups in (("live at the real peak only", c.real_only),
                          ("live at the predicted peak only", c.predicted_only)):
        if groups:
            console.print(f"{title}:")
            for g in groups[:_GROUPS_SHOWN]:
                console.print(f"  {g.count:>4} allocations, {_mib(g.nbytes):>12}  {g.label}", markup=False)
            if len(groups) > _GROUPS_SHOWN:
                console.print(f"  ... {len(groups) - _GROUPS_SHOWN} more groups (--json lists them all)")
    console.print(c.meaning, markup=False)
