"""``ktconvert gate``: the CI numeric regression gate over a declared suite of conversions and verifications.

Public API::

    from ktconvert.gate import load_suite, run_suite, junit_xml
    suite = load_suite("golden/suite.yaml")            # validated against schemas/gate-suite.schema.json
    result = run_suite(suite, select="q4_k", jobs=2)   # convert each case into a temp dir, then verify it
    result.passed, result.cases[0].breaches
    junit_xml(result)                                  # JUnit XML text: one testcase per case, failures name the metric
"""

from ktconvert.gate.junit import junit_xml
from ktconvert.gate.runner import CaseResult, GateResult, run_suite
from ktconvert.gate.suite import Case, Suite, default_suite_path, load_suite

__all__ = ["Case", "CaseResult", "GateResult", "Suite", "default_suite_path", "junit_xml", "load_suite", "run_suite"]
