"""``ktconvert verify``: run a model as an optimize-rule file injects it, on converted weights, against golden
Hugging Face outputs, and say where and by how much it leaves them.

Public API::

    from ktconvert.verify import run_verify, load_profile, EmulationOptions
    report = run_verify(model_dir, "rules/optimize/qwen3_moe.yaml", "golden/qwen3_moe",
                        weights="model-q4_k.gguf", profile="q4_k")      # or profile="auto"
    report.passed                       # the verdict
    report.breaches                     # [Breach(phase, metric, value, limit, op, where)]
    report.phase("decode").localization # {"layer": "layer 1", "module": "model.layers.1.mlp.experts", ...}
    report.as_dict()                    # schemas/verify-report.schema.json

Numeric regressions are a failing report, never an exception; unusable inputs raise
:class:`ktconvert.errors.InputError`. Torch is imported when a run starts, not by this package.
"""

from __future__ import annotations

from ktconvert.io.lazy import lazy_exports

from ktconvert.verify.profile import Breach, Profile, load_profile, shipped_profiles

# the run itself needs torch: these load on first use, so listing or checking never pays for it
_LAZY = {
    "run_verify": "ktconvert.verify.runner",
    "PhaseResult": "ktconvert.verify.runner",
    "VerifyReport": "ktconvert.verify.runner",
    "EmulationOptions": "ktconvert.model.inject",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = ["Breach", "EmulationOptions", "PhaseResult", "Profile", "VerifyReport", "load_profile", "run_verify",
           "shipped_profiles"]
