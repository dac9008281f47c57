"""Forecasters and their comparison (kvmesh.ops.planner.forecast)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.ops.planner.forecast import (
    LastValue,
    LstmForecaster,
    MovingAverage,
    SameTimeYesterday,
    compare,
    forecaster_named,
    mae,
)

PERIOD = 48


def _daily(days: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(days * PERIOD)
    return 100 + 60 * np.sin(2 * np.pi * t / PERIOD) + rng.normal(0, 5, t.size)


def test_baselines_follow_their_formulas() -> None:
    h = np.arange(1.0, 101.0)
    assert LastValue().predict(h, 0, 3).tolist() == [100.0] * 3
    assert MovingAverage(4).predict(h, 0, 2).tolist() == [98.5] * 2
    assert SameTimeYesterday(10).predict(h, 0, 3).tolist() == [91.0, 92.0, 93.0]
    assert SameTimeYesterday(200).predict(h, 0, 2).tolist() == [100.0, 100.0]  # less than a day: last value


def test_mae_needs_a_held_out_part_longer_than_the_horizon() -> None:
    with pytest.raises(ValueError, match="shorter than the horizon"):
        mae(LastValue(), np.ones(10), 8, 5)


def test_the_lstm_learns_a_daily_shape_and_beats_the_last_value() -> None:
    s = _daily(6)
    lstm = LstmForecaster(period=PERIOD, lookback=12, horizon=6, epochs=200, seed=0)
    cmp = compare(s, 5 * PERIOD, PERIOD, 6, lstm)
    assert cmp.lstm_mae < cmp.baselines["last_value"]
    assert set(cmp.baselines) == {"last_value", "same_time_yesterday", "moving_average"}
    assert cmp.chosen == (
        "lstm" if cmp.lstm_mae < min(cmp.baselines.values()) else min(cmp.baselines, key=cmp.baselines.get)
    )


def test_an_untrained_lstm_loses_and_the_planner_uses_a_baseline() -> None:
    s = _daily(4)
    cmp = compare(s, 3 * PERIOD, PERIOD, 6, LstmForecaster(period=PERIOD, lookback=12, horizon=6, epochs=1))
    assert cmp.chosen == "same_time_yesterday"
    assert cmp.lstm_mae > cmp.baselines["same_time_yesterday"]


def test_a_checkpointed_lstm_predicts_the_same_after_loading() -> None:
    s = _daily(3)
    a = LstmForecaster(period=PERIOD, lookback=12, horizon=6, epochs=20)
    a.fit(s, 0)
    b = LstmForecaster(period=PERIOD, lookback=12, horizon=6)
    b.load(a.checkpoint())
    np.testing.assert_allclose(a.predict(s, 0, 6), b.predict(s, 0, 6))
    assert forecaster_named("lstm", PERIOD, 6, b) is b
    with pytest.raises(RuntimeError, match="before fit"):
        LstmForecaster(period=PERIOD).predict(s, 0, 3)
