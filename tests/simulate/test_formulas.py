"""The closed-form activation formulas against values computed by hand."""

from __future__ import annotations

import pytest

from remat.simulate.formulas import (
    full_checkpoint_bytes,
    korthikanti_bytes,
    korthikanti_flash_bytes,
    rule_of_thumb_bytes,
)

# Llama-7B / GPT-3 6.7B shape: h = 4096, a = 32; s = 2048, b = 1.
S, B, H, A = 2048, 1, 4096, 32


def test_korthikanti_eq1_by_hand() -> None:
    # s*b*h*(34 + 5*a*s/h) = 2048*4096*(34 + 5*32*2048/4096) = 8388608 * 114
    assert korthikanti_bytes(seq_len=S, batch_size=B, hidden_size=H, n_heads=A) == 956_301_312
    assert 2048 * 4096 * 114 == 956_301_312


def test_korthikanti_s_squared_term_is_exact_when_h_does_not_divide() -> None:
    # s=3, b=2, h=5, a=7: s*b*(34h + 5as) = 6 * (170 + 105) = 1650 (a*s/h = 4.2 is not an int)
    assert korthikanti_bytes(seq_len=3, batch_size=2, hidden_size=5, n_heads=7) == 1650


def test_flash_variant_drops_the_attention_matrix() -> None:
    assert korthikanti_flash_bytes(seq_len=S, batch_size=B, hidden_size=H) == 34 * S * H
    assert korthikanti_flash_bytes(seq_len=S, batch_size=4, hidden_size=H) == 1_140_850_688
    full = korthikanti_bytes(seq_len=S, batch_size=4, hidden_size=H, n_heads=A)
    assert full - korthikanti_flash_bytes(seq_len=S, batch_size=4, hidden_size=H) \
        == 5 * A * S * S * 4


def test_rule_of_thumb_and_full_checkpointing() -> None:
    assert rule_of_thumb_bytes(seq_len=S, batch_size=B, hidden_size=H) == 201_326_592
    assert rule_of_thumb_bytes(seq_len=512, batch_size=8, hidden_size=768,
                               bytes_per_element=4) == 12 * 512 * 8 * 768 * 4
    assert full_checkpoint_bytes(seq_len=S, batch_size=B, hidden_size=H) == 16_777_216
    assert full_checkpoint_bytes(seq_len=S, batch_size=2, hidden_size=H,
                                 bytes_per_element=4) == 67_108_864


def test_fp32_scales_the_16bit_count() -> None:
    assert korthikanti_bytes(seq_len=S, batch_size=B, hidden_size=H, n_heads=A,
                             bytes_per_element=4) == 2 * 956_301_312


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        rule_of_thumb_bytes(seq_len=bad, batch_size=1, hidden_size=8)  # type: ignore[arg-type]
