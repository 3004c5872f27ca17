"""Only computes the package list: the found ``ktconvert`` packages plus the data folders mapped in pyproject."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["ktconvert", "ktconvert.*"]) + ["ktconvert._schemas", "ktconvert._rules", "ktconvert._golden"])
