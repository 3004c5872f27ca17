"""Package marker: ships the golden outputs and tiny-model hashes inside the wheel as ``ktconvert._golden``."""
