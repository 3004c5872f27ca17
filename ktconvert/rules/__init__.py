"""Optimize rules: safe loading with positions, the operator catalog, matching semantics and lint checks."""
