"""Renderings of a check-rules report: text for people, JSON for tools, GitHub workflow annotations."""

from __future__ import annotations

from ktconvert import __version__
from ktconvert.rules.findings import finding_dict, registry
from ktconvert.rules.lint import Report


def as_json(report: Report, strict: bool, elapsed_s: float) -> dict:
    """The document described by ``schemas/check-rules-report.schema.json``."""
    code = report.exit_code(strict)
    return {
        "tool": "ktconvert check-rules",
        "version": __version__,
        "status": {0: "ok", 1: "fail", 3: "error"}[code],
        "exit_code": code,
        "summary": {
            "files": len(report.files),
            "errors": report.count("error"),
            "warnings": report.count("warning"),
            "unreadable": sum(1 for r in report.files if r.error),
            "seconds": round(elapsed_s, 4),
        },
        "files": [
            {"path": r.path, "kind": r.kind, "backend": r.backend, "backend_source": r.backend_source, "rules": r.rules,
             "tree": r.tree, "error": r.error, **({"plan": r.plan} if r.plan is not None else {})}
            for r in report.files
        ],
        "findings": [finding_dict(f) for f in report.findings],
    }


def as_text(report: Report, verbosity: int, elapsed_s: float, style=lambda s, **kw: s) -> str:
    lines = []
    for r in report.files:
        if r.error:
            lines.append(style(f"{r.error}", fg="red"))
        for f in r.findings:
            color = "red" if f.severity == "error" else "yellow"
            rule = f" [rule {f.extra['rule_index']}]" if f.extra["rule_index"] is not None else ""
            lines.append(f"{f.where}:{f.line}:{f.col}: " + style(f"{f.id} {f.severity}", fg=color, bold=True) + f": {f.message}{rule}")
            if f.fix and verbosity >= 1:
                lines.append(f"    fix: {f.fix}")
        if r.plan is not None:
            lines.extend(plan_table(r.path, r.plan))
    if verbosity >= 1 or report.findings or any(r.error for r in report.files):
        checked = len(report.files)
        summary = (f"{checked} file{'s' if checked != 1 else ''} checked in {elapsed_s:.2f} s: "
                   f"{report.count('error')} error(s), {report.count('warning')} warning(s)")
        unreadable = sum(1 for r in report.files if r.error)
        if unreadable:
            summary += f", {unreadable} unreadable"
        lines.append(summary)
    return "\n".join(lines)


def as_github(report: Report) -> str:
    """``::error file=…,line=…,col=…,title=…::message`` lines, which GitHub Actions turns into annotations."""
    def esc(s: str) -> str:
        return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")

    def prop(s: str) -> str:
        return esc(s).replace(":", "%3A").replace(",", "%2C")

    out = []
    for r in report.files:
        if r.error:
            out.append(f"::error file={prop(r.path)},title=unreadable::{esc(r.error)}")
        for f in r.findings:
            level = "error" if f.severity == "error" else "warning"
            msg = f.message + (f" (fix: {f.fix})" if f.fix else "")
            out.append(f"::{level} file={prop(f.where)},line={f.line},col={f.col},title={f.id}::{esc(msg)}")
    return "\n".join(out)


def plan_table(path: str, rows: list[dict]) -> list[str]:
    head = ("module", "rule", "operator", "generate", "prefill", "ops")
    body = []
    for r in rows:
        ops = " ".join(f"{k.split('_')[0]}={v}" for k, v in r["ops"].items())
        body.append((r["module"], "-" if r["rule"] is None else str(r["rule"]), r["operator"],
                     str(r["generate_device"] or "-"), str(r["prefill_device"] or "-"), ops))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return [f"injection plan for {path} ({len(rows)} modules):", fmt.format(*head)] + [fmt.format(*b).rstrip() for b in body]


def list_checks() -> str:
    lines = []
    for c in registry().values():
        needs = {"tree": " (needs a module tree: --model, or a family the rule classes name)", "model": " (needs --model)",
                 "weights": " (needs --weights)"}.get(c.needs, "")
        lines.append(f"{c.id}  {c.severity:<7}  {c.title}{needs}")
    return "\n".join(lines)
