"""``--html``: one self-contained report page, readable offline.

plotly.js (shipped by the optional ``report`` extra, the plotly package, as
``package_data/plotly.min.js``: 4.8 MB in plotly 6) draws the charts. It is
embedded once, gzip-compressed (1.5 MB): the page inflates it with the
browser's own ``DecompressionStream`` and then draws each figure with
``Plotly.newPlot`` from its JSON (plotly's figure schema: ``data`` traces and a
``layout``), so the file opens with no network and stays well under 5 MB. The
figures are written as plain dicts: plotly's Python classes would validate
every point again, a third of a second on an 8B step. Nothing else is loaded: the
tables are plain HTML, sorted by a few lines of inline script. Once every
figure is drawn the page sets ``data-rendered`` on its body.

- ``llmem estimate --html``: the verdict, the memory timeline stacked by
  category with the peak marked (from the predicted snapshot's history), and
  reserved against allocated over the step (the replay's own timeline).
- ``llmem plan --html``: the verdict and what would make the job fit, one bar
  per candidate of its memory per rank by part, and the candidates table
  (sortable), with why each one was not chosen.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from llmem_plugin.errors import ConfigError

__all__ = ["estimate_page", "plan_page", "write_page"]

_MIB = 1 << 20
_GIB = 1 << 30
# Points per chart: enough to show every spike of a step, few enough for a page of a few MB.
_MAX_POINTS = 4000
_STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;font-size:0.9em}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{cursor:pointer;background:#f2f2f2}td:first-child,th:first-child{text-align:left}
.fits{color:#1a7f37}.nofit{color:#c0392b}.chosen{font-weight:bold;background:#eef7ee}"""
# Sort a table by the clicked column; numbers by the data-v value each cell carries.
_SORT_JS = """document.querySelectorAll('table.sortable th').forEach((th,i)=>th.addEventListener('click',()=>{
const t=th.closest('table'),b=t.tBodies[0],rows=[...b.rows],up=th.dataset.up!=='1';th.dataset.up=up?'1':'0';
rows.sort((x,y)=>{const a=x.cells[i].dataset.v??x.cells[i].textContent,c=y.cells[i].dataset.v??y.cells[i].textContent;
const n=parseFloat(a)-parseFloat(c);return (isNaN(n)?a.localeCompare(c):n)*(up?1:-1)});rows.forEach(r=>b.appendChild(r))}));"""


def _plotly_js() -> bytes:
    """plotly.min.js from the installed plotly package, or a ConfigError saying what to install."""
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    if path is None or not path.exists():
        raise ConfigError("the HTML report needs plotly. HINT: pip install 'llmem_plugin[report]'")
    return path.read_bytes()


# Inflates the embedded plotly.js, runs it, then draws every figure; errors are shown on the page.
_LOADER_JS = """(async()=>{try{const raw=atob(document.getElementById('plotly-gz').textContent.trim());
const bytes=new Uint8Array(raw.length);for(let i=0;i<raw.length;i++)bytes[i]=raw.charCodeAt(i);
const js=await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
const s=document.createElement('script');s.textContent=js;document.head.appendChild(s);
const figs=JSON.parse(document.getElementById('llmem-figures').textContent);
for(const f of figs){await Plotly.newPlot(f.id,f.fig.data,f.fig.layout,{displaylogo:false,responsive:true});}
document.body.dataset.rendered='1';}catch(e){document.body.insertAdjacentHTML('afterbegin',
'<p style="color:red">the charts could not be drawn: '+e+'</p>');console.error(e);}})();"""


def _plotly_gz() -> str:
    """plotly.js, gzip-compressed and base64-encoded (made once per process)."""
    global _PLOTLY_GZ
    if _PLOTLY_GZ is None:
        import base64
        import gzip

        _PLOTLY_GZ = base64.b64encode(gzip.compress(_plotly_js(), 6, mtime=0)).decode("ascii")
    return _PLOTLY_GZ


_PLOTLY_GZ: str | None = None


def _json_script(element_id: str, value: Any) -> str:
    text = (value if isinstance(value, str) else json.dumps(value)).replace("</", "<\\/")  # no early </script>
    return f"<script type='application/json' id='{element_id}'>{text}</script>"


def _page(title: str, body: list[str], data: dict[str, Any], figures: dict[str, Any]) -> str:
    """The page: ``figures`` (div id -> plotly figure) drawn into their divs; ``data`` in a JSON script
    tag (``llmem-data``) for tools and tests to read."""
    figs = json.dumps([{"id": k, "fig": fig} for k, fig in figures.items()])
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}"
            f"{_json_script('llmem-data', data)}{_json_script('llmem-figures', figs)}"
            f"<script type='application/octet-stream' id='plotly-gz'>{_plotly_gz()}</script>"
            f"<script>{_SORT_JS}</script><script>{_LOADER_JS}</script></body></html>")


def _figure(traces: list[dict[str, Any]], title: str, xtitle: str, ytitle: str, *,
            vline: tuple[float, str] | None = None, hline: tuple[float, str] | None = None) -> dict[str, Any]:
    """A plotly figure (plotly.js's schema): the traces, a title, axis titles, and a dashed marker line."""
    layout: dict[str, Any] = {"title": {"text": title}, "xaxis": {"title": {"text": xtitle}},
                              "yaxis": {"title": {"text": ytitle}}, "shapes": [], "annotations": []}
    if vline is not None:
        layout["shapes"].append({"type": "line", "xref": "x", "yref": "paper", "x0": vline[0], "x1": vline[0],
                                 "y0": 0, "y1": 1, "line": {"dash": "dash"}})
        layout["annotations"].append({"xref": "x", "yref": "paper", "x": vline[0], "y": 1, "text": vline[1],
                                      "showarrow": False, "xanchor": "left", "yanchor": "bottom"})
    if hline is not None:
        layout["shapes"].append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": hline[0],
                                 "y1": hline[0], "line": {"dash": "dash"}})
        layout["annotations"].append({"xref": "paper", "yref": "y", "x": 1, "y": hline[0], "text": hline[1],
                                      "showarrow": False, "xanchor": "right", "yanchor": "bottom"})
    return {"data": traces, "layout": layout}


def _div(div_id: str) -> str:
    return f"<div id='{div_id}' style='height:460px'></div>"


def write_page(page: str, path: str | Path) -> Path:
    """Write ``page`` to ``path``.

    Raises:
        ConfigError: The file cannot be written (the message names it).
    """
    path = Path(path)
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write the report to {str(path)!r}: {e.strerror}. "
                          "HINT: pass a path in a folder that exists and is writable") from None
    return path


def _thin(n: int, keep: list[int]) -> list[int]:
    """About :data:`_MAX_POINTS` indices of ``range(n)``, always with those in ``keep``."""
    if n <= _MAX_POINTS:
        return list(range(n))
    step = n / _MAX_POINTS
    return sorted({int(k * step) for k in range(_MAX_POINTS)} | {n - 1} | {k for k in keep if 0 <= k < n})


def _category_series(snap: dict[str, Any]) -> tuple[list[int], dict[str, list[int]], int]:
    """Bytes live per category after each entry of the predicted history (thinned), and the peak entry."""
    from llmem_plugin.snapshot.history import read_history

    h = read_history(snap)
    def name(a: Any) -> str:  # the writer files cuBLAS workspaces under 'unknown' (MemoryViz needs one)
        return "cuBLAS workspaces" if a.frames and a.frames[0].get("filename") == "cuBLAS" else a.category or "unknown"

    cats = sorted({name(a) for a in h.allocations})
    delta: dict[str, list[int]] = {c: [0] * len(h.entries) for c in cats}
    for a in h.allocations:
        c = name(a)
        delta[c][a.start] += a.size
        if a.end is not None:
            delta[c][a.end] -= a.size
    idx = _thin(len(h.entries), [h.peak_entry])
    series = {}
    for c in cats:
        run, cur, at = [], 0, set(idx)
        for n, d in enumerate(delta[c]):
            cur += d
            if n in at:
                run.append(cur)
        series[c] = run
    return idx, series, h.peak_entry


def _verdict_html(fits: bool, total: int, capacity: int, extra: str = "") -> str:
    cls, word = ("fits", "fits") if fits else ("nofit", "does not fit")
    return (f"<h2 class='{cls}'>The step {word}: {total / _GIB:.2f} GiB of {capacity / _GIB:.2f} GiB per GPU</h2>"
            + (f"<p>{html.escape(extra)}</p>" if extra else ""))


def estimate_page(est: Any, snap: dict[str, Any]) -> str:
    """The report of a single-GPU estimate and its predicted snapshot."""
    _plotly_js()  # a missing extra stops here, before anything is built
    idx, series, peak_entry = _category_series(snap)
    timeline = _figure([{"type": "scatter", "x": idx, "y": [v / _MIB for v in values], "name": cat,
                         "stackgroup": "one", "mode": "none"} for cat, values in series.items()],
                       "Memory by category over the step (predicted allocator history)", "history entry", "MiB",
                       vline=(peak_entry, "peak allocated"))
    points = est.memory_timeline
    peak = max((p[2] for p in points), default=est.peak_allocated_bytes)
    at = next((p[0] for p in points if p[2] == peak), 0)
    xs = [p[0] for p in points]
    frag = _figure([{"type": "scatter", "x": xs, "y": [p[3] / _MIB for p in points], "name": "reserved",
                     "mode": "lines"},
                    {"type": "scatter", "x": xs, "y": [p[2] / _MIB for p in points], "name": "allocated",
                     "mode": "lines", "fill": "tozeroy"}],
                   "Reserved against allocated (the gap is the allocator's cache and fragmentation)", "event", "MiB",
                   vline=(at, f"peak {peak / _GIB:.2f} GiB"))
    extra = "" if est.fits else (f"It needs {-est.headroom_bytes / _GIB:.2f} GiB more: try a smaller --batch-size, "
                                 "--grad-checkpointing, LoRA, or `llmem plan` for the methods over several GPUs.")
    rows = [("peak allocated", est.peak_allocated_bytes), ("peak reserved", est.peak_reserved_bytes),
            ("device total", est.device_total_bytes), ("capacity", est.capacity_bytes)]
    table = "".join(f"<tr><td>{k}</td><td data-v='{v}'>{v / _GIB:.3f} GiB</td></tr>" for k, v in rows)
    body = [f"<h1>{html.escape(est.model)} on {html.escape(est.gpu)}</h1>",
            _verdict_html(est.fits, est.device_total_bytes, est.capacity_bytes, extra),
            f"<table class='sortable'><thead><tr><th>figure</th><th>bytes</th></tr></thead><tbody>{table}</tbody>"
            "</table>",
            _div("timeline"), _div("reserved")]
    data = {"kind": "estimate", "peak_allocated_bytes": est.peak_allocated_bytes,
            "timeline_peak_bytes": peak, "fits": est.fits, "device_total_bytes": est.device_total_bytes}
    return _page(f"llmem: {est.model}", body, data, {"timeline": timeline, "reserved": frag})


def plan_page(result: Any) -> str:
    """The report of a plan: the verdict, the candidates' bars and the sortable candidates table."""
    _plotly_js()
    cands = list(result.candidates)
    parts = sorted({k for c in cands for k in c.segments})
    labels = [c.label() for c in cands]
    bars = _figure([{"type": "bar", "name": part, "x": labels, "y": [c.segments.get(part, 0) / _GIB for c in cands]}
                    for part in parts], "Memory per GPU (the largest rank) by part", "", "GiB",
                   hline=(result.capacity_bytes / _GIB, "capacity"))
    bars["layout"]["barmode"] = "stack"
    head = ["candidate", "method", "micro-batch", "checkpointing", "memory per GPU (GiB)", "step time (s)",
            "tokens/s", "verdict"]
    rows = []
    for c in cands:
        chosen = c is result.choice
        why = "chosen" if chosen else ("fits, not chosen" if c.fits and c.host_fits else "host RAM" if c.fits else
                                       f"over the limit by {-c.headroom_bytes / _GIB:.2f} GiB")
        cells = [(c.label(), None, "label"), (c.method_label, None, "method"),
                 (str(c.micro_batch), c.micro_batch, "mb"), ("on" if c.grad_checkpointing else "off", None, "ckpt"),
                 (f"{c.device_total_bytes / _GIB:.2f}", c.device_total_bytes, "mem"),
                 (f"{c.step_time_s:.3f}", c.step_time_s, "time"), (f"{c.tokens_per_s:,.0f}", c.tokens_per_s, "tps"),
                 (why, None, "why")]
        tds = "".join(f"<td class='{k}'{'' if v is None else f' data-v={v!r}'}>{html.escape(t)}</td>"
                      for t, v, k in cells)
        rows.append(f"<tr class='{'chosen' if chosen else ''}'>{tds}</tr>")
    skipped = "".join(f"<li>{html.escape(m)}: {html.escape(r)}</li>" for m, r in result.skipped)
    fits = result.choice is not None
    extra = "" if fits else "What would make it fit: " + "; ".join(
        f"{s.change} ({s.choice.label()}, {s.choice.device_total_bytes / _GIB:.2f} GiB)" for s in result.suggestions) \
        if result.suggestions else ""
    total = result.choice.device_total_bytes if fits else min((c.device_total_bytes for c in cands), default=0)
    body = [f"<h1>{html.escape(str(result.model))} on {result.layout.num_gpus} x {html.escape(result.gpu.name)}</h1>",
            _verdict_html(fits, total, result.capacity_bytes, extra),
            _div("ranks"),
            "<h2>Candidates</h2><table class='sortable' id='candidates'><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>",
            f"<h2>Methods that cannot run here</h2><ul>{skipped}</ul>" if skipped else ""]
    data = {"kind": "plan", "candidates": labels, "choice": result.choice.label() if fits else None}
    return _page(f"llmem plan: {result.model}", body, data, {"ranks": bars})
