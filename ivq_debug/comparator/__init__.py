"""Pinned metrics, budgets and the :class:`Comparison` of two dumps."""

from ivq_debug.comparator.budgets import Budget, Budgets
from ivq_debug.comparator.comparison import Comparison, compare, regressions_against
from ivq_debug.metrics import METRICS, compute

__all__ = ["METRICS", "Budget", "Budgets", "Comparison", "compare", "compute", "regressions_against"]
