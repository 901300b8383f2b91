"""Metric thresholds a Prefect trigger can test: triggers match resource labels by equality or by
prefix (``"3fb9*"``), never by number. So the publisher labels each committed epoch's metrics
with an *order key* (16 hex digits whose text order is the numbers' order) and a threshold
automation matches the finite set of prefixes that covers every key on one side of the
threshold's key: at most 15 per digit, 240 in all."""

from __future__ import annotations

import math
import struct

__all__ = ["METRIC_LABEL", "finite_number", "keys_above", "keys_below", "metric_labels",
           "order_key"]

METRIC_LABEL = "caffe2ckpt.metric-key."  # + the metric's name: its order key
_HEX = "0123456789abcdef"
_SIGN = 1 << 63
_ALL = (1 << 64) - 1


def order_key(value: float) -> str:
    """``value``'s key: -inf < ... < 0.0 (== -0.0) < ... < inf as text. NaN has none."""
    if math.isnan(value):
        raise ValueError("NaN has no order key")
    bits = struct.unpack(">Q", struct.pack(">d", float(value) + 0.0))[0]  # -0.0 + 0.0 is 0.0
    return f"{bits ^ _ALL if bits & _SIGN else bits | _SIGN:016x}"


def keys_below(value: float) -> list[str]:
    """The label patterns matching exactly the keys of numbers below ``value``."""
    key = order_key(value)
    return [f"{key[:i]}{c}*" for i, digit in enumerate(key) for c in _HEX[:_HEX.index(digit)]]


def keys_above(value: float) -> list[str]:
    """The label patterns matching exactly the keys of numbers above ``value``."""
    key = order_key(value)
    return [f"{key[:i]}{c}*" for i, digit in enumerate(key) for c in _HEX[_HEX.index(digit) + 1:]]


def finite_number(value: object) -> bool:
    """Whether ``value`` is an int or float (not a bool), neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def metric_labels(metrics: dict[str, object]) -> dict[str, str]:
    """The resource labels of an epoch's ``metrics``: an order key per finite number."""
    return {METRIC_LABEL + name: order_key(value) for name, value in metrics.items()
            if finite_number(value)}
