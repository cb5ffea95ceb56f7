import re

import pytest
import torch

from course import assert_close
from course.numerics import default_tolerance, describe


def fails(actual, expected, **kw) -> str:
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, **kw)
    return str(info.value)


def test_equal_values_pass_in_nested_structures():
    t = torch.randn(3, 4)
    assert_close((t, {"a": [t, 2.0]}), (t.clone(), {"a": [t.clone(), 2.0]}))


@pytest.mark.parametrize("seed", range(5))
def test_within_tolerance_passes_and_just_outside_fails(seed):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(5, 6, generator=g, dtype=torch.float64)
    assert_close(e + 0.5e-7, e, rtol=0, atol=1e-7)
    msg = fails(e + torch.where(torch.arange(30).view(5, 6) == 7, 1e-3, 0.0).double(), e, rtol=0, atol=1e-7)
    assert "1 of 30 elements differ" in msg and "index (1, 1)" in msg and "atol=1e-07" in msg


def test_shape_mismatch_names_the_part_and_suggests_a_transpose():
    msg = fails((torch.zeros(2, 3), torch.zeros(3, 2)), (torch.zeros(2, 3), torch.zeros(2, 3)), name="out")
    assert msg.startswith("out[1] does not match")
    assert "expected shape (2, 3), got (3, 2)" in msg and "transpose" in msg


def test_dtype_and_container_mismatches_are_explained():
    assert "expected dtype torch.float64" in fails(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert_close(torch.zeros(2), torch.zeros(2, dtype=torch.float64), check_dtype=False)
    assert "expected 2 items, got 3" in fails((1.0, 2.0, 3.0), (1.0, 2.0))
    assert "did the function forget to `return`" in fails(None, (torch.zeros(1), torch.zeros(1)))
    assert "missing ['b']" in fails({"a": 1.0}, {"a": 1.0, "b": 2.0})


def test_nan_is_reported_with_its_position_and_a_hint():
    a = torch.zeros(3, 3)
    a[2, 1] = float("nan")
    msg = fails(a, torch.zeros(3, 3), hint="check the padding")
    assert "1 of 9 elements are NaN (first at index (2, 1))" in msg and "Hint: check the padding" in msg
    assert_close(torch.tensor([float("nan")]), torch.tensor([float("nan")]), equal_nan=True)


def test_message_is_a_plain_assertion_without_internal_chaining():
    with pytest.raises(AssertionError) as info:
        assert_close(torch.ones(2), torch.zeros(2))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_default_tolerance_follows_the_least_precise_dtype():
    assert default_tolerance(torch.float32, torch.float64) == default_tolerance(torch.float32)
    assert default_tolerance(torch.int64) == (0.0, 0.0)
    assert re.search(r"shape \(2, 3\), float32", describe(torch.zeros(2, 3)))
