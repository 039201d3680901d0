"""torch.compile with the compiler's own activation memory budget, per model or per block.

The implementation lives in :mod:`remat.strategies.compiled` (``remat.apply`` compiles
plans made for compiled execution with it); this module re-exports it.

See :mod:`remat.strategies.compiled` for how the budget is applied per compile
(NOTE [ One backend per compile ]) and why identical blocks share a backend (NOTE [ One
backend per kind of block ]).

Example::

    >>> compiled = compile_with_budget(model, 0.5)             # whole model
    >>> compile_blocks_with_budget(model, 0.5)                 # each block, in place
    >>> compile_blocks_with_budget(model, {"blocks.0": 0.0})   # one block only
"""

from remat.strategies.compiled import compile_blocks_with_budget, compile_with_budget

__all__ = ["compile_blocks_with_budget", "compile_with_budget"]
