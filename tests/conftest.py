"""Suite-wide settings: one intra-op thread per test process, slow modules first.

`make test` runs two pytest workers on two cores; PyTorch's default of one thread
per core would oversubscribe them and make tiny steps many times slower.

NOTE [ Slow modules first ]
Under ``--dist loadscope`` each module (or test class) is one unit of work, handed to
whichever worker asks next in the order of the collection; xdist by default reorders the
units by their number of tests, which can put a module of a few slow tests last, where one
worker runs it while the other idles. The suite turns that reorder off and sorts the
collection so the slowest modules come first (longest processing time first): the short
ones at the end then even out the two workers. The weights are one idle core's seconds
per module (``--durations`` of a ``make test`` run; the compiled modules' from a run on a
cold inductor cache, as a fresh clone starts, where compiling C++ kernels doubles them);
the modules not in the table follow them, those of more tests first (xdist's own guess).
Only the order matters: a module missing from the table, or a stale figure, costs balance
only. The order within a module is kept.
"""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

#: Seconds of the slowest modules on one idle core, relative to this folder (NOTE [ Slow
#: modules first ]); the modules not listed follow, those of more tests first.
MODULE_SECONDS: dict[str, float] = {
    "compiled/test_simulate.py": 78, "compiled/test_measure.py": 75,
    "simulate/test_fast.py": 70, "simulate/test_plan_fast.py": 61, "integrations/test_tp.py": 61,
    "planning/test_fits_allocator.py": 43, "simulate/test_plan_rows.py": 35,
    "jax/test_planner.py": 31, "jax/test_candidates.py": 31, "compiled/test_plan.py": 30,
    "planning/test_planner.py": 29, "distributed/test_stage.py": 26, "cli/test_cli_jax.py": 26,
    "compiled/test_hf_decoder.py": 24, "simulate/test_accumulating.py": 18,
    "planning/test_shapes.py": 17, "distributed/test_pipeline.py": 17, "jax/test_measure.py": 16,
    "cli/test_cli_sources.py": 16, "cli/test_cli_seq_len.py": 16, "jax/test_parity.py": 15,
    "strategies/test_never_above_none.py": 13, "planning/test_device_budget.py": 13,
    "planning/test_context.py": 12, "simulate/test_run.py": 11, "planning/test_manual.py": 11,
    "planning/test_frontier_cli.py": 11, "planning/test_deterministic_plans.py": 11,
    "measure/test_doctor.py": 10, "planning/test_plan_chunked_head.py": 9,
    "measure/test_measure_hf_simulate.py": 9, "planning/test_seq_len.py": 8,
    "jax/test_plans_and_compare.py": 8, "benchmarks/test_bound.py": 8,
}


def pytest_configure(config: pytest.Config) -> None:
    # xdist's own reorder (units by test count) would undo the sort below.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slowest modules first (NOTE [ Slow modules first ]), each module's tests in their
    order."""
    first_seen: dict[str, int] = {}
    tests: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_module(item), len(first_seen))
        tests[_module(item)] = tests.get(_module(item), 0) + 1

    def weight(item: pytest.Item) -> tuple[float, int, int]:
        module = _module(item)
        return -MODULE_SECONDS.get(module, 0.0), -tests[module], first_seen[module]

    items.sort(key=weight)
