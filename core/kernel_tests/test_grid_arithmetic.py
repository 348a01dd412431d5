"""The launches' host-side grid arithmetic gives Triton's own results, without its overhead."""

from __future__ import annotations

import triton

from megamoe.core.kernels.launch import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_are_tritons() -> None:
    for n in range(1, 4200):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert next_power_of_2(1 << 40) == 1 << 40 and next_power_of_2((1 << 40) + 1) == 1 << 41
    for numerator in (*range(0, 2100), 40960, 1 << 33):
        for denominator in (1, 2, 3, 4, 7, 16, 128, 256, 1024):
            assert cdiv(numerator, denominator) == triton.cdiv(numerator, denominator)
