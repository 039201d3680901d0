"""Peak bytes per tiny HF model: real tracker vs simulate=True vs the CPU allocator.

Run from the repository root: ``PYTHONPATH=src python tests/measure/allocator_table.py [llama,t5]``.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    warnings.filterwarnings("ignore")
    import remat
    from remat.measure import profile

    hf, alloc = _load("hf_tiny"), _load("allocator_util")
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(hf.ARCHITECTURES)
    print(f"{'model':11s} {'strategy':8s} {'real':>8s} {'sim':>8s} {'alloc':>8s} "
          f"{'sim-real':>8s} {'alloc-real':>10s}")
    for name in names:
        for strategy in ("none", "full", "ops"):
            model, batch = hf.build_hf(name)
            remat.apply(model, strategy)
            real = profile(model, batch, timing=False)
            sim = profile(model, batch, simulate=True)
            static = real.param_bytes + real.buffer_bytes + real.batch_bytes
            peak = alloc.allocator_step_peak(model, batch, baseline_bytes=static)
            a = peak.absolute_peak_bytes
            print(f"{name:11s} {strategy:8s} {real.peak_bytes:8d} {sim.peak_bytes:8d} {a:8d} "
                  f"{sim.peak_bytes - real.peak_bytes:8d} {a - real.peak_bytes:10d}", flush=True)


if __name__ == "__main__":
    main()
