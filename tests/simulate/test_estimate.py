"""Formula estimates next to simulated per-layer bytes."""

from __future__ import annotations

import pytest

from remat.simulate.estimate import estimate
from remat.simulate.formulas import (
    korthikanti_bytes,
    korthikanti_flash_bytes,
    rule_of_thumb_bytes,
)


def test_estimate_table_on_llama_tiny() -> None:
    # llama-tiny: h = 64, a = 4, 2 layers.
    seen = []
    table = estimate("llama-tiny", seq_lens=[16, 8], batch_sizes=[2], dtype="fp32",
                     on_row=seen.append)
    assert (table.hidden_size, table.n_heads, table.n_layers) == (64, 4, 2)
    assert table.bytes_per_element == 4
    assert [(r.seq_len, r.checkpointing) for r in table.rows] == [
        (8, "none"), (8, "full"), (16, "none"), (16, "full")]
    assert seen == list(table.rows)
    full = table.rows[3]
    # Full checkpointing keeps exactly one fp32 hidden state per layer: 2·s·b·h at 4 bytes.
    assert full.simulated_bytes == 16 * 2 * 64 * 4
    only = full.estimates
    assert len(only) == 1 and only[0].name == "2sbh" and only[0].rel_error == 0.0
    none = table.rows[2]
    shape = dict(seq_len=16, batch_size=2, hidden_size=64, bytes_per_element=4)
    expected = {"12sbh": rule_of_thumb_bytes(**shape),
                "korthikanti": korthikanti_bytes(**shape, n_heads=4),
                "korthikanti-flash": korthikanti_flash_bytes(**shape)}
    assert {e.name: e.bytes for e in none.estimates} == expected
    for e in none.estimates:
        assert e.rel_error == pytest.approx((e.bytes - none.simulated_bytes)
                                            / none.simulated_bytes)
    assert none.estimate("2sbh") is None
    # Activations are linear in s for fused attention: half the sequence, half the bytes.
    assert table.rows[0].simulated_bytes * 2 == none.simulated_bytes
    assert '"checkpointing": "full"' in table.to_json()


def test_estimate_rejects_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'llama-13b'"):
        estimate("llama-13b")
