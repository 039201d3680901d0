"""Simulation arguments for tests of fit logic on tiny synthetic cards: fits judged on
allocated bytes, nothing outside the allocator, no workspaces (a tiny model's reserved
peak is one 2 MiB segment whatever it does, so these tests set the card between two
allocated peaks; NOTE [ Reserved per rank ] in remat/simulate/point.py)."""

from __future__ import annotations

from typing import Any

from remat.device_memory import OutsideMemory, Workspaces

ON_ALLOCATED: dict[str, Any] = {
    "fits_on": "allocated", "outside": OutsideMemory(context_bytes=0, nccl_bytes=0),
    "workspaces": Workspaces(cublas_bytes=0, cublaslt_bytes=0, cudnn_bytes=0)}
