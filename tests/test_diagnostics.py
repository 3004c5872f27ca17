"""The one finding record (ktconvert.diagnostics.Diagnostic) and the JSON shapes each command keeps for it."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from ktconvert.convert.lora_checks import finding, finding_dict, finding_line
from ktconvert.diagnostics import ERROR, WARNING, Diagnostic
from ktconvert.formats.layout import problem
from ktconvert.preflight import finding_dict as preflight_dict
from ktconvert.preflight import finding_line as preflight_line
from ktconvert.rules.findings import finding_dict as rules_dict


def test_a_diagnostic_is_frozen_and_its_extra_read_only():
    d = Diagnostic("KT102", ERROR, "duplicate key 'a'", "delete one", "r.yaml", 3, 1, {"rule_index": None})
    with pytest.raises(FrozenInstanceError):
        d.severity = WARNING
    with pytest.raises(TypeError):
        d.extra["rule_index"] = 0
    same = Diagnostic("KT102", ERROR, "duplicate key 'a'", "delete one", "r.yaml", 3, 1, {"rule_index": None})
    assert d == same and len({d, same}) == 1
    assert d != replace(d, extra={"rule_index": 0})


def test_each_command_keeps_its_json_shape():
    rules = Diagnostic("KT301", ERROR, "regex does not compile", "fix it", "r.yaml", 4, 7,
                       {"rule_index": 0, "path": "$[0]"})
    assert rules_dict(rules) == {"id": "KT301", "severity": ERROR, "file": "r.yaml", "line": 4, "col": 7,
                                 "message": "regex does not compile", "fix": "fix it", "rule_index": 0, "path": "$[0]"}
    pf = Diagnostic("PF124", ERROR, "LLAMAFILE needs I % 256 == 0", "use BF16", "--kt-method")
    assert preflight_dict(pf) == {"id": "PF124", "severity": ERROR, "where": "--kt-method",
                                  "message": "LLAMAFILE needs I % 256 == 0", "fix": "use BF16"}
    assert preflight_line(pf) == "error PF124 --kt-method: LLAMAFILE needs I % 256 == 0 (fix: use BF16)"
    assert preflight_line(replace(pf, where=None)) == "error PF124 LLAMAFILE needs I % 256 == 0 (fix: use BF16)"
    lora = finding(WARNING, "tensor x.lora_B", "all zero", "train it")
    assert finding_dict(lora) == {"severity": WARNING, "where": "tensor x.lora_B", "message": "all zero",
                                  "fix": "train it"}
    assert finding_line(lora) == "tensor x.lora_B: all zero (train it)"
    p = problem("extra-experts", "warning", "layer 2 has 9 experts", 2, ["a", "b"])
    assert (p.id, p.extra["layer"], p.extra["tensors"]) == ("extra-experts", 2, ("a", "b"))
