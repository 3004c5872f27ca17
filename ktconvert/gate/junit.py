"""JUnit XML for CI systems: one testcase per gate case; a failure names the case, the metric and the limit."""

from __future__ import annotations

from junitparser import Error, Failure, JUnitXml, TestCase, TestSuite

from ktconvert.gate.runner import GateResult


def junit_xml(result: GateResult) -> str:
    suite = TestSuite("ktconvert gate")
    for r in result.cases:
        case = TestCase(r.case.name, classname=f"ktconvert.gate.{r.case.family}", time=round(r.seconds, 3))
        if r.error:
            case.result = [Error(r.error, "case-error")]
        elif not r.passed:
            lines = [_breach_line(b) for b in r.breaches]
            where = ""
            if r.localization:
                where = "; first diverging: " + ", ".join(f"{k} {v}" for k, v in r.localization.items() if v)
            failure = Failure(f"{r.case.name}: {lines[0] if lines else 'failed'}", "numeric-regression")
            failure.text = "\n".join(lines) + where
            case.result = [failure]
        case.system_out = (f"rules={r.case.rules.name} conversion={r.case.conversion} tolerance={r.profile or r.case.tolerance} "
                           + " ".join(f"{ph}.{m}={_value(v)}" for ph, ms in r.summary.items() for m, v in ms.items() if v is not None))
        suite.add_testcase(case)
    xml = JUnitXml()
    xml.add_testsuite(suite)
    return xml.tostring().decode() if isinstance(xml.tostring(), bytes) else xml.tostring()


def _value(v) -> str:
    """A summary value: a number to 4 digits, a list of positions (the near-ties) as ``[a,b]``."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return f"{v:.4g}"


def _breach_line(b: dict) -> str:
    value = "NaN/Inf" if b.get("value") is None else f"{b['value']:.4g}"
    where = f" at {b['where']}" if b.get("where") else ""
    return f"{b['phase']} {b['metric']} = {value}, limit {b['op']} {b['limit']}{where}"
