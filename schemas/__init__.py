"""Package marker: ships the JSON Schemas inside the wheel as ``ktconvert._schemas`` (see pyproject.toml)."""
