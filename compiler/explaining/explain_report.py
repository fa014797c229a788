"""An explain bundle as one self-contained HTML page: no script, style or font from anywhere else.

The page embeds the bundle's index (``explain.json``), its profile
(``profile.json``) when there is one, and what the server adds (the model's
axis policies, the bucket's compile history); IR and code stay in their
files, linked (``links`` says where: next to the page on disk, or the
server's routes), so a page for a large model opens at once.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable
from pathlib import Path

from .explain_profile import PROFILE_FILE, TRACE_DIR

REPORT_FILE = "explain.json"
HTML_FILE = "index.html"

Links = Callable[[str, str], str]
"""(kind, name) -> href: kind ``ir`` (a stage), ``code`` (a module), ``trace`` (an engine), ``kernel_ir``
(a kernel's function in the last stage)."""


def bundle_links(report: dict) -> Links:
    """Links to the bundle's own files, for a page written next to them."""

    def link(kind: str, name: str) -> str:
        if kind == "ir":
            return report["ir"][name]["file"]
        if kind == "kernel_ir":
            return report["ir"][_last_stage(report)]["file"]
        if kind == "code":
            return report["code"][name]["file"]
        return f"{TRACE_DIR}/{name}.json"

    return link


def _last_stage(report: dict) -> str:
    return list(report["ir"])[-1]


def read_bundle(directory: Path) -> tuple[dict, dict | None]:
    report = json.loads((directory / REPORT_FILE).read_text())
    profile_path = directory / PROFILE_FILE
    profile = json.loads(profile_path.read_text()) if profile_path.is_file() else None
    return report, profile


def write_html(directory: Path, *, command: list[str]) -> Path:
    """``index.html`` next to the bundle's files."""
    report, profile = read_bundle(directory)
    page = render_html(report, profile, links=bundle_links(report), extra={"command": " ".join(command)})
    path = directory / HTML_FILE
    path.write_text(page)
    return path


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _ms(value) -> str:
    return "" if value is None else f"{value:.3f}"


def _table(headers: list[str], rows: list[list[str]], *, table_id: str = "", sortable: bool = False) -> str:
    head = "".join(f"<th scope='col'>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    attributes = (f" id='{table_id}'" if table_id else "") + (" class='sortable'" if sortable else "")
    return f"<table{attributes}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _kernel_rows(report: dict, profile: dict | None, links: Links) -> list[list[str]]:
    timed = {row["kernel"]: row for row in (profile or {}).get("kernels", [])}
    nodes = report["nodes"]
    rows = []
    for kernel in sorted(report["kernels"], key=lambda k: -((timed.get(k["name"]) or {}).get("tvm_ms") or 0.0)):
        row = timed.get(kernel["name"], {})
        names = [nodes[i]["name"] or f"{nodes[i]['op']} #{i}" for i in kernel["nodes"]]
        listed = ", ".join(_e(n) for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        ratio = row.get("tvm_over_ort")
        flops, size, tvm_ms = kernel.get("flops"), kernel.get("bytes"), row.get("tvm_ms")
        rate = f"{flops / (tvm_ms * 1e6):.1f}" if flops and tvm_ms else ""
        rows.append(
            [
                f"<code>{_e(kernel['name'])}</code>",
                _e(", ".join(kernel["ops"])),
                f"<span title='{_e(', '.join(names))}'>{listed}</span>",
                f"{flops / 1e6:.2f}" if flops else "",
                f"{size / 1e6:.2f}" if size else "",
                _ms(tvm_ms),
                rate,
                _e(row.get("calls", "")),
                _schedule_cell(kernel),
                _ms(row.get("ort_ms")),
                "" if ratio is None else f"<span class='{'slow' if ratio > 1 else 'fast'}'>{ratio:.2f}</span>",
                f"<a href='{_e(links('kernel_ir', kernel['name']))}'>TIR</a>",
            ]
        )
    return rows


def _schedule_cell(kernel: dict) -> str:
    if "schedule" not in kernel:
        return ""  # a bundle written before schedules were recorded
    if kernel["schedule"] is None:
        return "<span class='slow'>none: naive loops</span>"
    unit = kernel.get("unit")
    return _e(kernel["schedule"] + (f" ({unit})" if unit else ""))


def _summary(report: dict, profile: dict | None) -> str:
    coverage, graph = report["compute_coverage"], report["graph"]
    items = [
        ("kernels", len(report["kernels"])),
        ("kernels no rule scheduled", len(report.get("unscheduled", []))),
        ("compute nodes in a kernel", f"{coverage['in_a_kernel']} of {coverage['compute_nodes']}"),
        ("ONNX nodes", f"{graph['nodes']} ({graph['after_specialization']['nodes']} after specialization)"),
    ]
    if profile:
        tvm_ms, ort_ms = profile["tvm"]["run_ms"], profile["onnxruntime"]["run_ms"]
        items += [
            ("TVM run", f"{tvm_ms:.3f} ms"),
            ("ONNX Runtime run", f"{ort_ms:.3f} ms"),
            ("TVM / ONNX Runtime", f"{tvm_ms / ort_ms:.2f}" if ort_ms else "-"),
            ("run accounted for by the calls", f"{profile['accounted']:.0%}" if profile.get("accounted") else "-"),
        ]
        items += [(f"time on {unit}", share) for unit, share in unit_shares(report, profile).items()]
    return "<dl class='cards'>" + "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in items) + "</dl>"


def unit_shares(report: dict, profile: dict) -> dict[str, str]:
    """The kernels' time per unit their arithmetic ran on (an int8 dot product; the rest on the vector
    unit's float arithmetic), where some kernel ran on one: ``{"int8 on avx2 (vpmaddwd)": "41.2 ms (43%)"}``."""
    units = {kernel["name"]: kernel.get("unit") for kernel in report["kernels"]}
    if not any(units.values()):
        return {}
    times: dict[str, float] = {}
    for row in profile.get("kernels", []):
        unit = units.get(row["kernel"]) or "the vector unit (float)"
        times[unit] = times.get(unit, 0.0) + (row.get("tvm_ms") or 0.0)
    total = sum(times.values()) or 1.0
    return {unit: f"{ms:.3f} ms ({ms / total:.0%})" for unit, ms in sorted(times.items(), key=lambda kv: -kv[1])}


def _histogram(ops: dict[str, int]) -> str:
    return ", ".join(f"{_e(op)} {count}" for op, count in ops.items())


def render_html(report: dict, profile: dict | None, *, links: Links, extra: dict | None = None) -> str:
    """The report page. ``extra``: ``command`` (what wrote it), ``title``, ``axes`` (policy and padding
    verdict per axis), ``history`` (the bucket's compiles, newest first)."""
    extra = extra or {}
    label = " ".join(f"{name}={'x'.join(str(d) for d in dims)}" for name, dims in report["bucket"].items())
    title = extra.get("title") or f"explain {label}"
    stamp = report.get("stamp", {})
    stamp_line = ", ".join(f"{k} {v}" for k, v in stamp.items() if k not in ("target", "simplified"))
    parts = [
        f"<header><h1>{_e(title)}</h1><p class='meta'>bucket <code>{_e(label)}</code>; {_e(stamp_line)}; "
        f"written {_e(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}"
        + (f"; by <code>{_e(extra['command'])}</code>" if extra.get("command") else "")
        + "</p></header>",
        "<main>",
        "<section aria-labelledby='summary'><h2 id='summary'>Summary</h2>" + _summary(report, profile) + "</section>",
    ]
    target = stamp.get("target")
    shapes = [
        ["bucket", f"<code>{_e(label)}</code>"],
        ["verified at sizes", _e(json.dumps(report["verify_sizes"]) if report.get("verify_sizes") else "the bucket")],
        ["target", f"<code>{_e(json.dumps(target))}</code>" if target else ""],
        ["onnxsim simplified it", _e(stamp.get("simplified", ""))],
    ]  # fmt: skip
    for axis in extra.get("axes", []):
        shapes.append([f"axis {_e(axis['name'])}", _e(axis["policy"])])
    parts.append("<section aria-labelledby='shapes'><h2 id='shapes'>Shape decisions</h2>"
                 + _table(["", ""], shapes) + "</section>")  # fmt: skip
    graph = report["graph"]
    parts.append(
        "<section aria-labelledby='graph'><h2 id='graph'>Source graph</h2>"
        f"<p>opset {_e(graph['opset'])}, {graph['nodes']} nodes: {_histogram(graph['ops'])}</p>"
        f"<p>After specialization and onnxsim: {graph['after_specialization']['nodes']} nodes: "
        f"{_histogram(graph['after_specialization']['ops'])}</p></section>"
    )
    parts.append(
        "<section aria-labelledby='kernels'><h2 id='kernels'>Kernels</h2>"
        "<p>Each fused kernel, the ONNX nodes it computes, its work (MFLOP: its contractions' multiply-adds x2; "
        "MB: its parameters, read or written at least once), its time per run, what scheduled it (a default "
        "rule, a tuning record, or none: naive loops) and ONNX Runtime's time on the same nodes (click a "
        "column to sort).</p>"
        + _table(
            [
                "kernel",
                "ops",
                "ONNX nodes",
                "MFLOP",
                "MB",
                "TVM ms",
                "GFLOP/s",
                "calls",
                "scheduled by",
                "ONNX Runtime ms",
                "TVM / ORT",
                "code",
            ],
            _kernel_rows(report, profile, links),
            table_id="kernel-table",
            sortable=True,
        )
        + "</section>"
    )
    if profile:
        classes = [[_e(r["op_class"]), _ms(r["tvm_ms"]), _ms(r["ort_ms"]), _e(r["tvm_over_ort"] or "")]
                   for r in profile["by_class"]]  # fmt: skip
        other = [[f"<code>{_e(r['name'])}</code>", _e(r["op_class"]), _e(r["calls"]), _ms(r["ms"])]
                 for r in profile["tvm_other"] + profile["onnxruntime_unmatched"]]  # fmt: skip
        parts.append(
            "<section aria-labelledby='profile'><h2 id='profile'>Time by op class</h2>"
            + _table(["op class", "TVM ms", "ONNX Runtime ms", "TVM / ORT"], classes)
            + "<h3>Calls outside the kernel map</h3><p>The VM's own calls (allocations, shape checks) and the "
            "nodes ONNX Runtime added (layout reorders).</p>"
            + _table(["name", "class", "calls", "ms"], other)
            + "<p>Chrome traces of one run (open in Perfetto or <code>chrome://tracing</code>): "
            + ", ".join(f"<a href='{_e(links('trace', e))}'>{_e(e)}</a>" for e in ("tvm", "onnxruntime"))
            + f". Input shapes: <code>{_e(json.dumps(profile.get('input_shapes')))}</code>.</p></section>"
        )
    unmapped = [[_e(n["index"]), _e(n["op"]), _e(n["name"])] for n in report["not_in_a_kernel"]]
    parts.append(
        "<section aria-labelledby='unmapped'><h2 id='unmapped'>Nodes in no kernel</h2>"
        "<p>Folded into constants, shapes or the weights' layout, or turned into views.</p>"
        + (_table(["#", "op", "name"], unmapped) if unmapped else "<p>None.</p>")
        + "</section>"
    )
    files = [("ir", stage, entry) for stage, entry in report["ir"].items()]
    files += [("code", kind, entry) for kind, entry in report.get("code", {}).items()]
    listed = [
        [f"<a href='{_e(links(kind, name))}'>{_e(name)}</a>", f"{entry['bytes']:,}", "cut" if entry["cut"] else ""]
        for kind, name, entry in files
    ]
    parts.append(
        "<section aria-labelledby='ir'><h2 id='ir'>IR after each stage, and the generated code</h2>"
        + _table(["file", "bytes", ""], listed)
        + "</section>"
    )
    if "history" in extra:
        parts.append(_history(extra["history"]))
    parts.append("</main>")
    return _PAGE.format(title=_e(title), style=_STYLE, body="\n".join(parts), script=_SCRIPT)


def _history(history: list[dict]) -> str:
    rows = [
        [_e(h.get("when", "")), _e(h.get("reason", "")), _e(", ".join(h.get("changed", [])) or "-"),
         _e(h.get("compile_seconds", "")), f"<code>{_e(str(h.get('key', ''))[:16])}</code>"]
        for h in history
    ]  # fmt: skip
    return (
        "<section aria-labelledby='history'><h2 id='history'>Compile history</h2>"
        "<p>Each compile of this bucket, newest first, and what changed in its key against the one before.</p>"
        + (_table(["when", "reason", "changed", "seconds", "key"], rows) if rows else "<p>None recorded.</p>")
        + "</section>"
    )


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2329;background:#fafbfc}
header{background:#1d2329;color:#fff;padding:12px 24px}header h1{margin:0;font-size:20px}
.meta{margin:4px 0 0;color:#c9d1d9;font-size:12px}main{padding:8px 24px 40px}
h2{font-size:16px;margin:24px 0 8px}table{border-collapse:collapse;background:#fff;margin:4px 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4}.sortable th{cursor:pointer}td:nth-child(n+4){font-variant-numeric:tabular-nums}
.cards{display:flex;flex-wrap:wrap;gap:8px;margin:0}.cards div{background:#fff;border:1px solid #d0d7de;
padding:6px 12px}.cards dt{font-size:12px;color:#57606a}.cards dd{margin:0;font-size:18px}
.slow{color:#b42318}.fast{color:#1a7f37}code{font-size:12px}
"""

_SCRIPT = """
document.querySelectorAll('table.sortable').forEach(function (table) {
  table.querySelectorAll('th').forEach(function (th, column) {
    th.tabIndex = 0;
    function sort() {
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var descending = th.dataset.order !== 'desc'; th.dataset.order = descending ? 'desc' : 'asc';
      rows.sort(function (a, b) {
        var x = a.cells[column].textContent, y = b.cells[column].textContent;
        var nx = parseFloat(x), ny = parseFloat(y);
        var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
        return descending ? -c : c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    }
    th.addEventListener('click', sort);
    th.addEventListener('keydown', function (e) { if (e.key === 'Enter') sort(); });
  });
});
"""

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{style}</style></head>
<body>{body}<script>{script}</script></body></html>
"""
