"""Compiled training (``torch.compile``): measured, simulated, planned and installed.

One package for everything remat does with compiled steps; it imports nothing itself, so
importing a submodule loads only what that submodule needs. By role:

* ``graphs``: the counting backend every remat compile goes through (one per compile and
  budget), and the FLOPs and runs of the partitioned graphs it logs.
* ``measure``: a compiled step measured at the allocator (``profile_compiled``,
  ``measure_compiled``).
* ``capture``, ``replay``, ``simulate``: a compiled step simulated on fake tensors by
  replaying inductor's own generated code (``simulate_compiled``).
* ``install``: compiling a model, its blocks or a plan's blocks at a compiler budget
  (``compile_with_budget``, ``compile_blocks_with_budget``, ``compile_plan``).
* ``candidates``, ``plan``: compiled candidates and the compiled planner
  (``remat.plan_compiled``).

The package is a vertical slice of the layers (docs/architecture.md, tests/test_layers.py):
``remat.profile`` measures compiled models, ``remat.apply`` compiles a plan's blocks and
``remat.plan_compiled`` plans compiled steps, so each module sits in the layer of what it builds on
(graphs to simulate: measure; install: strategies; candidates and plan: planning) and no
import goes up a layer.
"""

__all__: list[str] = []
