"""remat's framework-neutral core: what the PyTorch planner and the JAX backend share.

Budgets (``budget``), the peak model over memory windows (``peak``), the solver that
picks one candidate per block (``solver``), record checks (``checks``), and the result
records both backends return: profiles (``results``, ``ops``), comparison rows
(``rows``) and gradient-parity reports (``parity``), with the step cost they all embed and
the byte categories every breakdown uses (``cost``).

Nothing here imports torch or jax, and nothing here imports another remat package but
``remat.errors``, ``remat.units`` and ``remat.native`` (the lowest layer,
``tests/test_layers.py``). Candidates reach the peak model and the solver through a
protocol (NOTE [ Candidate protocol ] in ``peak.py``). The package imports no submodule
eagerly: ``import remat.core.budget`` loads the budget alone.
"""
