"""Order keys and threshold patterns (caffe2ckpt.prefect.orderkey), matched the way Prefect's
triggers match labels: every pair of numbers, on both sides of every threshold."""

from __future__ import annotations

import math
import random

import pytest
from prefect.events.schemas.events import matches

from caffe2ckpt.prefect.orderkey import keys_above, keys_below, metric_labels, order_key

EDGES = [-math.inf, -1.7976931348623157e308, -2.5, -1.0, -5e-324, -0.0, 0.0, 5e-324, 1e-300,
         0.1, 0.25, 1.0, 2.0, 3.0, 1e300, math.inf]


def numbers(seed: int, count: int = 100) -> list[float]:
    rng = random.Random(seed)
    return EDGES + [rng.uniform(-10, 10) for _ in range(count)] + [
        rng.choice((-1, 1)) * 10 ** rng.uniform(-300, 300) for _ in range(count)]


def test_keys_sort_as_the_numbers_and_patterns_select_one_side():
    values = numbers(seed=0)
    assert all((order_key(a) < order_key(b)) == (a < b) for a in values for b in values)
    for threshold in random.Random(1).sample(values, 12) + EDGES:
        below, above = keys_below(threshold), keys_above(threshold)
        assert len(below) + len(above) <= 16 * 15
        for value in values:
            key = order_key(value)
            assert any(matches(p, key) for p in below) == (value < threshold), (threshold, value)
            assert any(matches(p, key) for p in above) == (value > threshold), (threshold, value)


def test_only_finite_numbers_are_labelled():
    labels = metric_labels({"loss": 0.5, "acc": 1, "nan": math.nan, "inf": math.inf,
                            "flag": True, "text": "0.5"})
    assert labels == {"caffe2ckpt.metric-key.loss": order_key(0.5),
                      "caffe2ckpt.metric-key.acc": order_key(1.0)}
    with pytest.raises(ValueError, match="NaN"):
        order_key(math.nan)
