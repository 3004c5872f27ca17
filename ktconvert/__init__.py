"""ktconvert: validate optimize rules, convert MoE expert layouts, and gate numerics against golden outputs."""

__version__ = "0.1.0"
