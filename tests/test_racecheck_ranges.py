"""racecheck.ranges: the bytes a tensor view covers, as sorted runs of addresses.

Checked against a brute-force oracle that lists every element's bytes, over views of every
shape and stride hypothesis makes (transposed, expanded, overlapping), derandomised."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from racecheck.ranges import LIMIT, byte_runs, clip, extent, merge, row_runs

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)
DTYPES = [torch.uint8, torch.float16, torch.float32, torch.int64]


def oracle(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """Every element's bytes, merged."""
    base, itemsize = tensor.data_ptr(), tensor.element_size()
    starts = [base + itemsize * sum(i * s for i, s in zip(index, tensor.stride()))
              for index in itertools.product(*(range(n) for n in tensor.shape))]
    return merge((s, s + itemsize) for s in starts)


def row_oracle(tensor: torch.Tensor, dim: int, rows: list[int]) -> list[tuple[int, int]]:
    size = tensor.shape[dim]
    runs: list[tuple[int, int]] = []
    for row in rows:
        if -size <= row < size:
            runs.extend(oracle(tensor.select(dim, row)))
    return merge(runs)


def covers(outer: list[tuple[int, int]], inner: list[tuple[int, int]]) -> bool:
    return all(any(s <= a and b <= e for s, e in outer) for a, b in inner)


@st.composite
def views(draw, max_dims: int = 3) -> torch.Tensor:
    """A strided view over a fresh storage: any sizes (0 included) and strides (0 and overlapping included)."""
    ndim = draw(st.integers(0, max_dims))
    sizes = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim))
    offset = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    needed = offset + sum((n - 1) * s for n, s in zip(sizes, strides) if n) + 1
    return torch.zeros(needed, dtype=dtype).as_strided(sizes, strides, offset)


# -- byte_runs ------------------------------------------------------------------------------------

def test_a_contiguous_tensor_is_one_run():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert byte_runs(kv) == [(base, base + 128)]


def test_a_slice_of_rows_is_one_run():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert byte_runs(kv[2:4]) == [(base + 32, base + 64)]
    assert byte_runs(kv[3]) == [(base + 48, base + 64)]


def test_a_column_is_one_run_per_element():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert byte_runs(kv[:, 1]) == [(base + 4 + 16 * i, base + 8 + 16 * i) for i in range(8)]


def test_a_block_of_a_matrix_is_one_run_per_row():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert byte_runs(kv[1:3, 1:3]) == [(base + 20, base + 28), (base + 36, base + 44)]


def test_a_transposed_tensor_covers_the_same_bytes():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert byte_runs(kv.t()) == [(base, base + 128)]
    assert byte_runs(kv.t()[1]) == byte_runs(kv[:, 1])


def test_a_permuted_tensor_covers_the_same_bytes():
    x = torch.zeros(2, 3, 4, dtype=torch.int64)
    assert byte_runs(x.permute(2, 0, 1)) == byte_runs(x)


def test_an_expanded_tensor_covers_only_the_bytes_it_repeats():
    row = torch.zeros(4)
    base = row.data_ptr()
    assert byte_runs(row.expand(3, 4)) == [(base, base + 16)]
    one = torch.zeros(1, dtype=torch.int64)
    assert byte_runs(one.expand(5)) == [(one.data_ptr(), one.data_ptr() + 8)]


def test_an_expanded_column_is_one_run_per_row():
    x = torch.zeros(3, 1)
    base = x.data_ptr()
    assert byte_runs(x.expand(3, 5)) == [(base, base + 12)]
    y = torch.zeros(3, 2)[:, :1]
    assert byte_runs(y.expand(3, 5)) == [(y.data_ptr() + 8 * i, y.data_ptr() + 8 * i + 4) for i in range(3)]


def test_an_empty_tensor_covers_nothing():
    kv = torch.zeros(8, 4)
    assert byte_runs(torch.zeros(0)) == []
    assert byte_runs(kv[3:3]) == []
    assert byte_runs(kv[:, 4:]) == []
    assert byte_runs(torch.zeros(0, 4).expand(0, 4)) == []


def test_a_scalar_tensor_is_one_element():
    x = torch.tensor(3.0, dtype=torch.float64)
    assert byte_runs(x) == [(x.data_ptr(), x.data_ptr() + 8)]


def test_a_view_with_more_runs_than_the_limit_is_given_as_its_extent():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    column = kv[:, 1]
    assert byte_runs(column, limit=8) == [(base + 4 + 16 * i, base + 8 + 16 * i) for i in range(8)]
    assert byte_runs(column, limit=7) == [(base + 4, base + 4 + 7 * 16 + 4)]
    assert byte_runs(column, limit=7) == extent(column)


def test_the_default_limit_lists_every_run_up_to_it():
    x = torch.zeros(LIMIT, 2, dtype=torch.uint8)
    assert len(byte_runs(x[:, 0])) == LIMIT
    y = torch.zeros(LIMIT + 1, 2, dtype=torch.uint8)
    assert byte_runs(y[:, 0]) == [(y.data_ptr(), y.data_ptr() + 2 * LIMIT + 1)]


def test_extent_is_first_to_last_byte():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert extent(kv[1:3, 1:3]) == [(base + 20, base + 44)]
    assert extent(kv) == [(base, base + 128)]
    assert extent(kv[2:2]) == []


@SETTINGS
@given(views())
def test_byte_runs_are_exactly_the_bytes_of_every_element(view):
    assert byte_runs(view) == oracle(view)


@SETTINGS
@given(views(), st.integers(1, 6))
def test_byte_runs_beyond_the_limit_cover_every_element_with_the_extent(view, limit):
    found = byte_runs(view, limit=limit)
    expected = oracle(view)
    assert found == expected or found == extent(view)
    assert covers(found, expected)


# -- row_runs -------------------------------------------------------------------------------------

def test_the_docstring_example_holds():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert row_runs(kv, 0, [1, 5]) == [(base + 16, base + 32), (base + 80, base + 96)]


def test_neighbouring_rows_are_one_run():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert row_runs(kv, 0, [2, 1]) == [(base + 16, base + 48)]


def test_rows_along_dim_1_are_columns():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert row_runs(kv, 1, [3]) == [(base + 12 + 16 * i, base + 16 + 16 * i) for i in range(8)]
    assert row_runs(kv, -1, [3]) == row_runs(kv, 1, [3])


def test_rows_along_dim_2_of_a_three_dimensional_tensor():
    x = torch.zeros(2, 3, 4, dtype=torch.int64)
    assert row_runs(x, 2, [0, 3]) == row_oracle(x, 2, [0, 3])
    assert len(row_runs(x, 2, [0])) == 6


def test_negative_rows_count_from_the_end():
    kv = torch.zeros(8, 4)
    assert row_runs(kv, 0, [-1]) == row_runs(kv, 0, [7])
    assert row_runs(kv, 0, [-8]) == row_runs(kv, 0, [0])


def test_rows_out_of_range_are_skipped():
    kv = torch.zeros(8, 4)
    assert row_runs(kv, 0, [8, -9, 100]) == []
    assert row_runs(kv, 0, [8, 2, -9]) == row_runs(kv, 0, [2])


def test_a_row_named_twice_counts_once():
    kv = torch.zeros(8, 4)
    assert row_runs(kv, 0, [3, 3, -5]) == row_runs(kv, 0, [3])


def test_no_rows_cover_nothing():
    assert row_runs(torch.zeros(8, 4), 0, []) == []
    assert row_runs(torch.zeros(0, 4), 0, [0, -1]) == []


def test_rows_of_a_view_are_rows_of_the_view():
    kv = torch.zeros(8, 4)
    view = kv[2:6]
    assert row_runs(view, 0, [0]) == byte_runs(kv[2])
    assert row_runs(kv.t(), 0, [1]) == byte_runs(kv[:, 1])


def test_rows_of_a_scalar_are_the_scalar():
    x = torch.tensor(1.0)
    assert row_runs(x, 0, [5]) == byte_runs(x)


def test_rows_with_more_runs_than_the_limit_fall_back_to_the_whole_view():
    kv = torch.zeros(8, 4)
    base = kv.data_ptr()
    assert row_runs(kv, 1, [0], limit=4) == [(base, base + 128)]
    assert row_runs(kv[:, :2], 1, [0], limit=4) == extent(kv[:, :2])


@SETTINGS
@given(views(), st.data())
def test_row_runs_are_exactly_the_bytes_of_the_rows_named(view, data):
    if view.dim() == 0:
        return
    dim = data.draw(st.integers(-view.dim(), view.dim() - 1), label="dim")
    size = view.shape[dim]
    rows = data.draw(st.lists(st.integers(-size - 2, size + 2), max_size=5), label="rows")
    assert row_runs(view, dim, rows) == row_oracle(view, dim % view.dim(), rows)


# -- merge and clip -------------------------------------------------------------------------------

@pytest.mark.parametrize(("runs", "merged"), [
    ([], []),
    ([(0, 4)], [(0, 4)]),
    ([(8, 12), (0, 4)], [(0, 4), (8, 12)]),
    ([(0, 4), (4, 8)], [(0, 8)]),
    ([(0, 10), (2, 4)], [(0, 10)]),
    ([(6, 9), (0, 4), (3, 7)], [(0, 9)]),
    ([(0, 4), (5, 8)], [(0, 4), (5, 8)]),
])
def test_merge_sorts_and_joins_runs_that_meet_or_touch(runs, merged):
    assert merge(runs) == merged


def test_merge_accepts_any_iterable():
    assert merge(iter([(4, 8), (0, 4)])) == [(0, 8)]


@pytest.mark.parametrize(("runs", "start", "end", "clipped"), [
    ([(0, 8), (16, 24)], 4, 20, [(4, 8), (16, 20)]),
    ([(0, 8), (16, 24)], 8, 16, []),
    ([(0, 8)], 0, 8, [(0, 8)]),
    ([(0, 8)], -5, 100, [(0, 8)]),
    ([], 0, 8, []),
    ([(0, 8), (16, 24)], 24, 32, []),
])
def test_clip_keeps_the_parts_inside(runs, start, end, clipped):
    assert clip(runs, start, end) == clipped
