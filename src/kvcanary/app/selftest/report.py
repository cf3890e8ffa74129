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


def html_report(
    baseline: Sequence[CaseOutcome], summaries: Sequence[NameSummary], *, command: str = ""
) -> str:
    """A self-contained HTML page: the result table, catch rate per fault and a latency histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.name for s in summaries]
    rates = [s.as_json()["seeds_caught_1to1"] / max(1, len(s.outcomes)) for s in summaries]  # type: ignore[operator]
    fig, ax = plt.subplots(figsize=(9, 3.5))
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
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(latencies, bins=range(0, max(latencies, default=0) + 2), align="left", rwidth=0.8)
    ax.set_xlabel("detection latency (steps)")
    ax.set_ylabel("faults")
    ax.set_title("Detection latency")
    lat_png = _png(fig)
    plt.close(fig)
    doc = campaign_json(baseline, summaries)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r.values()) + "</tr>"
        for r in doc["results"]  # type: ignore[attr-defined]
    )
    head = "".join(
        f"<th>{html.escape(k)}</th>" for k in (doc["results"][0] if doc["results"] else {})
    )  # type: ignore[index]
    verdict = "PASSED" if doc["passed"] else "FAILED"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcanary selftest</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}</style></head><body>"
        f"<h1>kvcanary selftest: {verdict}</h1>"
        f"<p>Clean baseline: {doc['clean_baseline']}</p>"  # type: ignore[index]
        f"<table><tr>{head}</tr>{rows}</table>"
        f"<h2>Catch rate</h2><img src='data:image/png;base64,{rate_png}'>"
        f"<h2>Latency</h2><img src='data:image/png;base64,{lat_png}'>"
        "</body></html>"
    )
