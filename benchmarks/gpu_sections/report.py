"""The GPU suite's report: gpu_suite.json, and gpu_suite.md rendered from it."""
import os

from .common import write_json


def write_report(report: dict, out: str) -> None:
    write_json(os.path.join(out, "gpu_suite.json"), report)
    tmp = os.path.join(out, "gpu_suite.md.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render_markdown(report))
    os.replace(tmp, os.path.join(out, "gpu_suite.md"))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns: list, rows: list) -> list:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def render_markdown(report: dict) -> str:
    h = report["header"]
    lines = [f"# ignite-amp GPU suite: {h['device']}", "",
             "| device | driver | CUDA | torch | Ignite | date |", "|---|---|---|---|---|---|",
             f"| {h['device']} | {h['driver']} | {h['cuda']} | {h['torch']} | {h['ignite']} | {h['date']} |", "",
             f"Mode: {report['mode']}. `{report['command']}`: {report.get('seconds', 0):.0f} s in all "
             f"(budget on one H100: {report['total_budget_s']} s). Python {h['python']}, torchvision "
             f"{h.get('torchvision')}, CPU {h['cpu']} x {h['cpu_count']}.", ""]
    for s in report["sections"].values():
        status = s["status"] + (f": {s['reason']}" if s.get("reason") else "")
        lines += [f"## {s['title']}", "",
                  f"**{status}** ({s['seconds']:.1f} s; budget {s['budget_s']:.0f} s; expected on one H100 "
                  f"~{s['expected_h100_s']} s)", ""]
        for table in s["tables"]:
            caption = table["name"] + (" (CPU stand-in run, not a measurement)" if s["status"] == "skipped" else "")
            lines += [f"*{caption}*", ""] + _table(table["columns"], table["rows"]) + [""]
        if s["targets"]:
            lines += _table(["target", "value", "verdict"], s["targets"]) + [""]
        lines += [f"- {note}" for note in s["notes"]] + ([""] if s["notes"] else [])
        if s.get("traceback"):
            lines += ["```", s["traceback"].strip()[-1500:], "```", ""]
    return "\n".join(lines)
