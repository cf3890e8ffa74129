"""Self-test results as a Rich table, a JSON document and an HTML page with plots."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence

from rich.table import Table

from kvcanary.app.selftest.campaign import CaseOutcome, NameSummary

__all__ = ["campaign_json", "campaign_passed", "html_report", "result_table"]


def campaign_passed(baseline: Sequence[CaseOutcome], summaries: Sequence[NameSummary]) -> bool:
    """Every mode and plant caught 1:1 on every seed, and a silent clean baseline."""
    return all(o.violations == 0 for o in baseline) and all(s.passed for s in summaries)


def campaign_json(
    baseline: Sequence[CaseOutcome], summaries: Sequence[NameSummary]
) -> dict[str, object]:
    """The `--json` document."""
    return {
        "passed": campaign_passed(baseline, summaries),
        "clean_baseline": {
            "seeds": len(baseline),
            "violations": sum(o.violations for o in baseline),
        },
        "results": [s.as_json() for s in summaries],
    }


def result_table(baseline: Sequence[CaseOutcome], summaries: Sequence[NameSummary]) -> Table:
    """One row per mode or plant."""
    clean = sum(o.violations for o in baseline)
    table = Table(
        title=f"kvcanary selftest (clean baseline: {len(baseline)} seeds, {clean} violations)"
    )
    for col in ("name", "kind", "seeds", "injections", "1:1", "any", "missed", "false alarms", "cascade",
                "latency med/max", "reasons seen", "expected", "ok"):  # fmt: skip
        table.add_column(
            col, justify="left" if col in ("name", "kind", "reasons seen", "expected") else "right"
        )
    for s in summaries:
        j = s.as_json()
        table.add_row(
            s.name, s.kind, str(j["seeds"]), str(j["injections"]), str(j["seeds_caught_1to1"]),
            str(j["seeds_caught_any"]), str(j["missed"]), str(j["false_alarms"]), str(j["cascade_rows"]),
            f"{j['latency_steps_median']}/{j['latency_steps_max']}", " ".join(s.reasons_seen and sorted(s.reasons_seen)),
            " ".join(sorted(s.reasons_expected)), "[green]yes[/]" if s.passed else "[red]NO[/]",
        )  # fmt: skip
    return table


def _png(fig: object) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")  # type: ignore[attr-defined]
    return base64.b64encode(buf.getvalue()).decode("ascii")


_CSS = (
    "body{font-family:sans-serif;margin:1.5em;max-width:1360px;color:#222}"
    "table{border-collapse:collapse;width:100%;table-layout:fixed}"
    "td,th{border:1px solid #ccc;padding:3px 5px;font-size:12px;overflow-wrap:anywhere;"
    "vertical-align:top;text-align:left}"
    "th{background:#eee}tr.pass td.ok{background:#c8efd4}tr.fail td{background:#fbd5d5}"
    "code{font-size:11px;overflow-wrap:anywhere}img{max-width:100%;height:auto}"
    ".verdict-pass{color:#17803d}.verdict-fail{color:#b42318}"
)
_COLUMNS = (  # header, width (%)
    ("name", 10), ("kind", 4), ("seeds", 4), ("injections", 5), ("caught 1:1", 4),
    ("caught any", 4), ("missed", 4), ("false alarms", 4), ("cascade rows", 4),
    ("latency med / max (steps)", 6), ("reasons seen", 13), ("reasons expected", 13),
    ("replay (first failing seed, else the first seed)", 21), ("ok", 4),
)  # fmt: skip


def _text(value: object) -> str:
    """A JSON value as readable text: lists joined, None as a dash (never Python syntax)."""
    if value is None:
        return "-"
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(str(v) for v in value) or "-"
    return str(value)


def _row(s: NameSummary) -> str:
    j = s.as_json()
    failing = [o for o in s.outcomes if not o.correlation.one_to_one]
    replay = (failing or list(s.outcomes))[0].replay if s.outcomes else ""
    cells = [
        s.name, s.kind, j["seeds"], j["injections"], j["seeds_caught_1to1"], j["seeds_caught_any"],
        j["missed"], j["false_alarms"], j["cascade_rows"],
        f"{_text(j['latency_steps_median'])} / {_text(j['latency_steps_max'])}",
        _text(j["reasons_seen"]), _text(j["reasons_expected"]),
    ]  # fmt: skip
    tds = "".join(f"<td>{html.escape(_text(c))}</td>" for c in cells)
    tds += f"<td><code>{html.escape(replay)}</code></td>"
    tds += f"<td class='ok'>{'yes' if s.passed else 'NO'}</td>"
    return f"<tr class='{'pass' if s.passed else 'fail'}'>{tds}</tr>"


def html_report(
    baseline: Sequence[CaseOutcome], summaries: Sequence[NameSummary], *, command: str = ""
) -> str:
    """A self-contained HTML page: verdict, version and command line, the result table (pass /
    fail coloured, a replay command per row), catch rate per fault and a latency histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from kvcanary import __version__

    names = [s.name for s in summaries]
    rates = [sum(o.correlation.one_to_one for o in s.outcomes) / max(1, len(s.outcomes))
             for s in summaries]  # fmt: skip
    fig, ax = plt.subplots(figsize=(12, 3.8))
    ax.bar(names, rates, color=["#2a7" if s.passed else "#c33" for s in summaries])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("seeds caught 1:1")
    ax.set_title("Catch rate per fault mode / planted bug")
    ax.tick_params(axis="x", rotation=60)
    rate_png = _png(fig)
    plt.close(fig)
    latencies = [
        lat
        for s in summaries
        for o in s.outcomes
        for lat in o.correlation.latencies
        if lat is not None
    ]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(latencies, bins=range(0, max(latencies, default=0) + 2), align="left", rwidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("detection latency (steps)")
    ax.set_ylabel("faults")
    ax.set_title("Detection latency")
    lat_png = _png(fig)
    plt.close(fig)
    passed = campaign_passed(baseline, summaries)
    verdict = "PASSED" if passed else "FAILED"
    clean = sum(o.violations for o in baseline)
    cols = "".join(f"<col style='width:{w}%'>" for _, w in _COLUMNS)
    head = "".join(f"<th>{html.escape(h)}</th>" for h, _ in _COLUMNS)
    rows = "".join(_row(s) for s in summaries)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcanary selftest</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1 class='verdict-{verdict.lower()}'>kvcanary selftest: {verdict}</h1>"
        f"<p>kvcanary {html.escape(__version__)} &middot; command: "
        f"<code>{html.escape(command or 'kvcanary selftest')}</code></p>"
        f"<p>Clean baseline: {len(baseline)} seeds, {clean} violations "
        f"({'silent' if clean == 0 else 'NOT silent'}).</p>"
        f"<table><colgroup>{cols}</colgroup><tr>{head}</tr>{rows}</table>"
        f"<h2>Catch rate</h2><img alt='catch rate' src='data:image/png;base64,{rate_png}'>"
        f"<h2>Latency</h2><img alt='latency' src='data:image/png;base64,{lat_png}'>"
        "</body></html>"
    )
