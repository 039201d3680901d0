"""torch.compile with the compiler's own activation memory budget, per model or per block.

The implementation lives in :mod:`remat.strategies.compiled` (``remat.apply`` compiles
plans made for compiled execution with it); this module re-exports it.

``torch._functorch.config.activation_memory_budget`` (0.0 to 1.0) tells AOTAutograd's
min-cut partitioner what fraction of the activations to keep; below 1.0 it
recomputes (matmuls included) to save the rest. It is a global setting read when a
graph is partitioned, and dynamo reuses compiled graphs across ``torch.compile``
calls that share a backend, so setting it globally between two compiles does not
do what it says (see NOTE [ One backend per compile ] in
``remat/measure/compiled_graphs.py``). These helpers give every compile its own
:class:`~remat.measure.compiled_graphs.CountingBackend`, which patches the budget
only while inductor compiles and logs the partitioned graphs' FLOPs, so
:func:`remat.measure.compiled.profile_compiled` can report compiled FLOPs and
recompute exactly.

NOTE [ One backend per kind of block ]
    Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) compiled
    entries per code object, and every backend is a separate entry: one backend
    per block would make the 9th block of a 12-layer model silently run eagerly.
    Blocks that compile to the same graph (same class, same parameter shapes, same
    remat regions and budget) therefore share one backend, and dynamo reuses one
    compiled graph for all of them (it inlines ``nn.Module`` calls, so parameters
    are graph inputs); each kind of block costs one entry. ``profile_compiled``
    attributes that graph to every block that shares it (each runs it once).

Example::

    >>> compiled = compile_with_budget(model, 0.5)             # whole model
    >>> compile_blocks_with_budget(model, 0.5)                 # each block, in place
    >>> compile_blocks_with_budget(model, {"blocks.0": 0.0})   # one block only
"""

from remat.strategies.compiled import compile_blocks_with_budget, compile_with_budget

__all__ = ["compile_blocks_with_budget", "compile_with_budget"]
