"""Regenerating a suite's goldens: a person's act, refused under CI and logged in every manifest it touches."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ktconvert.gate.suite import Suite
from ktconvert.golden.generate import generate_golden, refuse_under_ci
from ktconvert.model.tiny import write_tiny_model
from ktconvert.model.tiny_lora import write_tiny_lora


def regenerate_goldens(suite: Suite, reason: str, select: str | None = None) -> list[Path]:
    """Rebuild the golden of every distinct (family, golden) the selected cases use, from the tiny models (a case
    naming a model directory: from that model, within its ``max_memory``)."""

    refuse_under_ci()  # before any work: a CI job must never make a regression green
    done: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="ktconvert-regen-") as tmp:
        for case in suite.select(select):
            if case.golden in done:
                continue
            if case.model is not None:
                generate_golden(case.model, case.golden, force=True, reason=reason, max_memory=case.max_memory)
                done.append(case.golden)
                continue
            model = Path(tmp) / case.tiny
            if not model.is_dir():
                write_tiny_model(case.family, model, variant=case.variant)
            adapter = None
            if case.lora:  # the golden of a lora case is made with the adapter the case applies
                adapter = Path(tmp) / f"{case.tiny}-lora"
                if not adapter.is_dir():
                    write_tiny_lora(case.family, adapter)
            generate_golden(model, case.golden, force=True, reason=reason, lora=adapter)
            done.append(case.golden)
    return done
