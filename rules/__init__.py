"""Package marker: ships the rule files, catalogs and recipes inside the wheel as ``ktconvert._rules``."""
