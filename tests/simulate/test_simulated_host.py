"""NOTE [ Simulated host ]: ``remat simulate`` prices a GPU's step, so offloading strategies
move what they move there, though the fake tensors say ``cpu``."""

from __future__ import annotations

import warnings

from remat.errors import RematWarning
from remat.simulate import simulate


def test_offloading_strategies_leave_the_simulated_device() -> None:
    kwargs = dict(seq_len=128, batch_sizes=(1, 2), dtype="fp32", plan=False,
                  strategies=["none", "full", "offload", "full_offload"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RematWarning)  # no "same as full here" notice
        fast = simulate("llama-tiny", **kwargs)  # type: ignore[arg-type]
    exact = simulate("llama-tiny", exact=True, **kwargs)  # type: ignore[arg-type]
    rows = {(r.strategy, r.batch_size): r for r in exact.rows}
    assert [(r.strategy, r.batch_size, r.peak_bytes, r.activation_bytes) for r in fast.rows] \
        == [(r.strategy, r.batch_size, r.peak_bytes, r.activation_bytes) for r in exact.rows]
    for b in (1, 2):
        none, full = rows["none", b], rows["full", b]
        offload, full_offload = rows["offload", b], rows["full_offload", b]
        assert offload.activation_bytes < none.activation_bytes
        assert full_offload.activation_bytes < full.activation_bytes
        assert full_offload.peak_bytes <= full.peak_bytes
