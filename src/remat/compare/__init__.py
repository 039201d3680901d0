"""Strategies side by side: every strategy (and a plan) measured on one model and batch.

:func:`~remat.compare.runner.compare` runs each strategy on a fresh copy of the model,
measures one step exactly, checks gradients and times the steps interleaved;
:mod:`~remat.compare.frontier` puts the manual strategies and the planner's plans on one
peak-against-recompute frontier. Results are :class:`~remat.core.rows.ComparisonResult`
(framework-neutral: the JAX backend returns it too) and
:class:`~remat.compare.frontier.Frontier`; :mod:`remat.report` draws them.
"""
