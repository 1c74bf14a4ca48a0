"""The tests' provenance encoding (``_provenance``) is exact and one-to-one in every dtype it is
used with, and the check behind it catches the encodings that were not."""
import pytest
import torch
from _provenance import assert_exact, exact_values, provenance, significant_bits


def test_significant_bits():
    assert [significant_bits(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64)] == \
        [8, 11, 24, 53]


@pytest.mark.parametrize("dtype,codes", [(torch.bfloat16, 15000), (torch.float16, 7168), (torch.float32, 20000)])
def test_codes_map_to_distinct_exact_values(dtype, codes):
    values = exact_values(torch.arange(codes), [dtype])  # asserts the round trip itself
    assert torch.equal(values[:2 ** significant_bits(dtype)][:100], torch.arange(100, dtype=torch.float64))
    cast = values.to(dtype)
    assert cast.unique().numel() == codes and torch.isfinite(cast).all()


def test_versions_and_tags_differ_in_every_element():
    a = provenance((3, 5), 1, 2, dtypes=(torch.float32, torch.bfloat16))
    b = provenance((3, 5), 2, 2, dtypes=(torch.float32, torch.bfloat16))
    c = provenance((3, 5), 1, 3, dtypes=(torch.float32, torch.bfloat16))
    assert not (a == b).any() and not (a == c).any()
    assert set(a.flatten().tolist()).isdisjoint(b.flatten().tolist())


def test_the_check_rejects_values_a_dtype_rounds():
    # What tests/test_refit.py once used: ~101000 in float16 is inf, ~201000 in bfloat16 rounds to
    # multiples of 1024, and even 256 * tag + i is not exact in bfloat16 past 256.
    for values, dtype in [(torch.arange(30) + 101000.0, torch.float16), (torch.arange(90) + 201000.0, torch.bfloat16),
                          (torch.arange(256) + 256.0, torch.bfloat16)]:
        with pytest.raises(AssertionError, match="not exact"):
            assert_exact(values.double(), dtype)
    with pytest.raises(AssertionError, match="not exact"):
        exact_values(torch.arange(7169), [torch.float16])  # past float16's largest finite value
