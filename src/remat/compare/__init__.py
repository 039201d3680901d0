"""Strategies side by side: every strategy (and a plan) measured on one model and batch.

:func:`~remat.compare.runner.compare` runs each strategy on a fresh copy of the model,
measures one step exactly, checks gradients and times the steps interleaved;
:mod:`~remat.compare.frontier` puts the manual strategies and the planner's plans on one
peak-against-recompute frontier. Results are :class:`~remat.compare.rows.ComparisonResult`
and :class:`~remat.compare.frontier.Frontier`; :mod:`remat.report` draws them.
"""

from remat.compare.rows import ComparisonResult, StrategyRow

__all__ = ["ComparisonResult", "StrategyRow"]
