"""Byte formatting matches c10's format_size exactly up to 1 TiB (then TiB and PiB), and parsing
reads every spelling back."""
import pytest

from ipy_gpumem.core.units import GiB, KiB, MiB, format_bytes, format_delta, parse_bytes


@pytest.mark.parametrize("size, text", [
    (0, "0 bytes"),
    (512, "512 bytes"),
    (1024, "1024 bytes"),          # torch prints 1024 bytes, not 1.00 KiB
    (1025, "1.00 KiB"),
    (MiB, "1024.00 KiB"),          # and 1 MiB as 1024.00 KiB
    (MiB + 1, "1.00 MiB"),
    (GiB, "1024.00 MiB"),
    (GiB + 1, "1.00 GiB"),
    (1610612736, "1.50 GiB"),
    (20 * MiB, "20.00 MiB"),
    (1024 * GiB, "1024.00 GiB"),    # c10 stops at GiB; past 1 TiB we go on as memory_summary does
    (1024 * GiB + 1, "1.00 TiB"),
    (131072 * GiB, "128.00 TiB"),  # not "131072.00 GiB"
    (1024**5, "1024.00 TiB"),
    (1024**5 + 1, "1.00 PiB"),
    (2**64, "16384.00 PiB"),
    (None, "n/a"),
    (-3 * GiB, "-3.00 GiB"),
])
def test_format_bytes_is_torchs_format_size(size, text):
    assert format_bytes(size) == text


def test_format_delta_signs():
    assert format_delta(0) == "+0 bytes"
    assert format_delta(2 * GiB) == "+2.00 GiB"
    assert format_delta(-512 * MiB) == "-512.00 MiB"
    assert format_delta(None) == "n/a"


@pytest.mark.parametrize("text, size", [
    ("0 bytes", 0),
    ("256 bytes", 256),
    ("1024.00 KiB", MiB),
    ("1024.00 MiB", GiB),
    ("2.32 GiB", 2491081032),        # round half up of the exact decimal product
    ("20.00 MiB", 20 * MiB),
    ("3.34GiB", round(3.34 * GiB)),
    ("6.04 GB", 6485400617),         # MPS/TF "GB" is binary
    ("72GB", 72 * GiB),
    ("16M", 16 * MiB),
    ("17179869184.00 GiB", 2**64),   # exact beyond uint64
    ("1.5 TiB", int(1.5 * 1024**4)),
    (4096, 4096),
    ("  7 ", 7),
])
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


def test_parse_bytes_is_exact_for_long_numbers():
    assert parse_bytes("12345678901234567890123456.7 bytes") == 12345678901234567890123457
    assert parse_bytes("99999999999999999999999999999 bytes") == 99999999999999999999999999999


@pytest.mark.parametrize("bad", ["", "GiB", "1.2.3 GiB", "12 parsecs", "lots", True, "1e3 MiB", "\u0663 GiB", "9" * 100])
def test_parse_bytes_rejects_with_a_hint(bad):
    with pytest.raises(ValueError) as err:
        parse_bytes(bad)
    assert "size" in str(err.value) or "unit" in str(err.value)


@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 5 * MiB + 17, 3 * GiB + 12345, 123456789012])
def test_round_trip_within_display_precision(size):
    back = parse_bytes(format_bytes(size))
    assert abs(back - size) <= max(size * 0.005, 0)
