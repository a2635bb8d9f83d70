"""Testing support: golden-graph cases and the pytest plugin that runs them."""

from .golden import GoldenCase, GoldenResult, check_goldens, find_goldens

__all__ = ["GoldenCase", "GoldenResult", "check_goldens", "find_goldens"]
