"""The forecasters' edges (kvmesh.ops.planner.forecast): the LSTM's window bounds and what it reads, the baselines
past a day, the comparison's split and its JSON. The LSTMs here are tiny (a few hidden units, a few epochs) so
each test takes milliseconds; they pin which values reach the model, not how well it forecasts."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.ops.planner.forecast import (
    Comparison,
    LastValue,
    LstmForecaster,
    MovingAverage,
    SameTimeYesterday,
    compare,
    forecaster_named,
    mae,
)

PERIOD = 8
LOOKBACK, HORIZON = 4, 3


def _series(n: int) -> np.ndarray:
    t = np.arange(n)
    return 100.0 + 40.0 * np.sin(2 * np.pi * t / PERIOD)


def _tiny_lstm(epochs: int = 30) -> LstmForecaster:
    return LstmForecaster(period=PERIOD, lookback=LOOKBACK, horizon=HORIZON, hidden=4, epochs=epochs, seed=0)


def _trained() -> LstmForecaster:
    lstm = _tiny_lstm()
    lstm.fit(_series(3 * PERIOD), 0)
    return lstm


def test_the_lstm_trains_on_a_series_of_exactly_one_window_and_refuses_a_shorter_one() -> None:
    one_window = _tiny_lstm(epochs=1)
    one_window.fit(_series(LOOKBACK + HORIZON), 0)  # lookback + horizon buckets: one (inputs → targets) window
    assert one_window.predict(_series(LOOKBACK), 0, HORIZON).shape == (HORIZON,)
    with pytest.raises(ValueError, match=r"^series of 6 buckets is shorter than lookback \+ horizon$"):
        _tiny_lstm(epochs=1).fit(_series(LOOKBACK + HORIZON - 1), 0)


def test_the_lstm_reads_exactly_the_last_lookback_buckets() -> None:
    lstm = _trained()
    history = _series(2 * PERIOD)
    tail = history[-LOOKBACK:]
    # a history of exactly `lookback` buckets goes to the model, and the model sees nothing older: a longer history
    # with the same tail (at the same time of day) forecasts the same
    from_tail = lstm.predict(tail, history.size - LOOKBACK, HORIZON)
    np.testing.assert_allclose(from_tail, lstm.predict(history, 0, HORIZON))
    assert from_tail.tolist() != LastValue().predict(tail, 0, HORIZON).tolist()


def test_the_lstm_forecast_follows_the_last_bucket() -> None:
    # the last hidden state, the one that has read the newest bucket, is what the head maps to the forecast
    lstm = _trained()
    history = _series(2 * PERIOD)
    spiked = history.copy()
    spiked[-1] *= 5.0
    assert not np.allclose(lstm.predict(history, 0, HORIZON), lstm.predict(spiked, 0, HORIZON))


def test_the_lstm_forecasts_the_last_value_for_a_history_shorter_than_its_lookback() -> None:
    lstm = _trained()
    short = np.array([7.0, 9.0, 11.0])
    assert lstm.predict(short, 0, 2).tolist() == [11.0, 11.0]
    assert lstm.predict(short, 0, HORIZON).tolist() == [11.0] * HORIZON


def test_the_lstm_forecast_is_float64_and_never_negative() -> None:
    pred = _trained().predict(_series(2 * PERIOD), 0, HORIZON)
    assert pred.dtype == np.float64 and (pred >= 0).all()


def test_an_untrained_lstm_refuses_to_predict_with_its_exact_message() -> None:
    with pytest.raises(RuntimeError, match=r"^LstmForecaster\.predict before fit or load$"):
        _tiny_lstm().predict(_series(PERIOD), 0, 1)


def test_same_time_yesterday_beyond_a_day_repeats_the_newest_value() -> None:
    # a 3-bucket day, 5 buckets ahead: h = 1..3 are yesterday's buckets 8, 9, 10; h = 4, 5 would be today's,
    # unknown yet, so the newest value stands in
    history = np.arange(1.0, 11.0)
    assert SameTimeYesterday(3).predict(history, 0, 5).tolist() == [8.0, 9.0, 10.0, 10.0, 10.0]


def test_compare_needs_a_test_split_inside_the_series() -> None:
    s = _series(3 * PERIOD)
    for bad in (0, s.size, -1):
        with pytest.raises(ValueError, match=rf"^test_from {bad} must split the {s.size}-bucket series$"):
            compare(s, bad, PERIOD, 2, _tiny_lstm(epochs=1))


def test_a_comparison_rounds_its_maes_to_four_places_in_json() -> None:
    cmp = Comparison(1.234567, {"last_value": 2.345678, "moving_average": 3.0}, "last_value")
    assert cmp.to_json() == {
        "lstm_mae": 1.2346,
        "baselines": {"last_value": 2.3457, "moving_average": 3.0},
        "chosen": "last_value",
    }


def test_an_untrained_lstm_refuses_a_checkpoint_with_its_exact_message() -> None:
    with pytest.raises(RuntimeError, match=r"^nothing to checkpoint: the LSTM is not trained$"):
        _tiny_lstm().checkpoint()


def test_the_lstm_is_scored_at_the_time_of_day_it_was_fitted_at() -> None:
    # compare fits the LSTM with the series starting at bucket 0, and mae asks it from bucket 0 too: the same time
    # of day in training and in scoring
    s = _series(3 * PERIOD)
    lstm = _tiny_lstm(epochs=5)
    cmp = compare(s, 2 * PERIOD, PERIOD, 2, lstm)
    origins = range(2 * PERIOD, s.size - HORIZON + 1)
    errors = [np.abs(lstm.predict(s[:t], 0, HORIZON) - s[t : t + HORIZON]) for t in origins]
    assert cmp.lstm_mae == pytest.approx(float(np.mean(errors)))


def test_the_lstm_scale_is_the_training_mean_however_small() -> None:
    lstm = _tiny_lstm(epochs=1)
    lstm.fit(np.full(LOOKBACK + HORIZON, 0.25), 0)
    assert lstm.scale == pytest.approx(0.25)
    idle = _tiny_lstm(epochs=1)
    idle.fit(np.zeros(LOOKBACK + HORIZON), 0)  # no load at all: a tiny positive scale, no division by zero
    assert 0 < idle.scale <= 1e-9 and np.isfinite(idle.predict(np.zeros(LOOKBACK), 0, HORIZON)).all()


def test_the_baselines_forecast_zero_for_an_empty_history() -> None:
    empty = np.zeros(0)
    for f in (LastValue(), MovingAverage(3), SameTimeYesterday(3)):
        assert f.predict(empty, 0, 2).tolist() == [0.0, 0.0]


class _LastValueLstm(LstmForecaster):
    """A stand-in for a trained LSTM that forecasts exactly as the last-value baseline (for compare's choice)."""

    def fit(self, series: np.ndarray, start_bucket: int) -> None:
        self._model = "stand-in"

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        return LastValue().predict(history, start_bucket, horizon)


class _OracleLstm(_LastValueLstm):
    """A stand-in for an LSTM that forecasts the held-out truth exactly (MAE 0)."""

    truth: np.ndarray = np.zeros(0)

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        return self.truth[history.size : history.size + horizon].astype(float)


def test_the_lstm_is_chosen_only_when_strictly_better_than_every_baseline() -> None:
    rising = np.arange(40.0)  # a ramp: the last value is the best baseline
    tie = compare(rising, 30, PERIOD, 4, _LastValueLstm(period=PERIOD, horizon=2))
    assert tie.lstm_mae == tie.baselines["last_value"] == min(tie.baselines.values())
    assert tie.chosen == "last_value"
    oracle = _OracleLstm(period=PERIOD, horizon=2)
    oracle.truth = rising
    won = compare(rising, 30, PERIOD, 4, oracle)
    assert (won.lstm_mae, won.chosen) == (0.0, "lstm")


def test_compare_accepts_a_split_after_the_first_bucket() -> None:
    cmp = compare(np.arange(10.0), 1, PERIOD, 4, _LastValueLstm(period=PERIOD, horizon=2))
    assert cmp.baselines["last_value"] == 1.5  # every origin 1..8 of a ramp: errors 1 and 2


def test_compare_fits_the_lstm_on_the_part_before_the_split_from_bucket_0() -> None:
    s = _series(3 * PERIOD)
    lstm = _tiny_lstm(epochs=5)
    compare(s, 2 * PERIOD, PERIOD, 2, lstm)
    reference = _tiny_lstm(epochs=5)
    reference.fit(s[: 2 * PERIOD], 0)
    np.testing.assert_allclose(lstm.predict(s, 0, HORIZON), reference.predict(s, 0, HORIZON), rtol=1e-6)


def test_a_forecaster_is_found_by_its_name_with_the_zones_periods() -> None:
    lstm = _tiny_lstm()
    assert forecaster_named("same_time_yesterday", 24, 12, lstm) == SameTimeYesterday(24)
    assert forecaster_named("moving_average", 24, 12, lstm) == MovingAverage(12)
    assert forecaster_named("last_value", 24, 12, lstm) == LastValue()
    with pytest.raises(ValueError, match=r"^unknown forecaster 'arima'$"):
        forecaster_named("arima", 24, 12, lstm)


def test_mae_without_an_origin_says_so_exactly() -> None:
    with pytest.raises(ValueError, match=r"^no forecast origin in the held-out part: it is shorter than the horizon$"):
        mae(LastValue(), np.ones(10), 8, 5)


def test_the_lstm_runs_torch_on_one_thread() -> None:
    import torch

    torch.set_num_threads(2)
    _tiny_lstm(epochs=1).fit(_series(LOOKBACK + HORIZON), 0)
    assert torch.get_num_threads() == 1


def test_the_learning_rate_is_the_one_configured() -> None:
    history = _series(2 * PERIOD)
    slow, fast = _tiny_lstm(epochs=3), LstmForecaster(PERIOD, LOOKBACK, HORIZON, hidden=4, epochs=3, lr=0.1)
    slow.fit(history, 0)
    fast.fit(history, 0)
    assert not np.allclose(slow.predict(history, 0, HORIZON), fast.predict(history, 0, HORIZON))


class _NotATensor:
    """A pickled object that is not a tensor: a checkpoint holding it could run code when unpickled."""


def test_a_checkpoint_holding_anything_but_tensors_is_refused() -> None:
    import io
    import pickle

    import torch

    saved = torch.load(io.BytesIO(_trained().checkpoint()), weights_only=True)
    buf = io.BytesIO()
    torch.save({**saved, "extra": _NotATensor()}, buf)
    with pytest.raises(pickle.UnpicklingError):
        _tiny_lstm().load(buf.getvalue())


def test_the_lstm_refuses_a_horizon_beyond_the_trained_one_naming_both() -> None:
    with pytest.raises(ValueError, match=r"^horizon 4 > the trained horizon 3$"):
        _trained().predict(_series(2 * PERIOD), 0, HORIZON + 1)


def test_the_lstm_forecast_scales_with_the_load() -> None:
    # inputs are divided by the training mean and outputs multiplied by it: a load ten times (or a thousand times
    # smaller) gives the same forecast, scaled
    base = _series(3 * PERIOD)
    history = _series(2 * PERIOD + 3)
    forecasts = []
    for factor in (1.0, 10.0, 0.001):
        lstm = _tiny_lstm()
        lstm.fit(base * factor, 0)
        forecasts.append(lstm.predict(history * factor, 0, HORIZON) / factor)
    np.testing.assert_allclose(forecasts[1], forecasts[0], rtol=1e-4)
    np.testing.assert_allclose(forecasts[2], forecasts[0], rtol=1e-4)


def test_the_lstm_window_is_the_last_lookback_buckets_in_time_order() -> None:
    lstm = _trained()
    history = _series(2 * PERIOD + 3)  # not a whole number of days
    base = lstm.predict(history, 0, HORIZON)
    older = history.copy()
    older[-LOOKBACK - 1] *= 5.0  # just before the window: not read
    np.testing.assert_allclose(lstm.predict(older, 0, HORIZON), base)
    oldest = history.copy()
    oldest[-LOOKBACK] *= 5.0  # the window's oldest bucket: read
    assert not np.allclose(lstm.predict(oldest, 0, HORIZON), base)
    # the same window at its own time of day, given as a shorter history
    np.testing.assert_allclose(lstm.predict(history[3:], 3, HORIZON), base)


def test_the_lstm_reads_the_time_of_day_with_a_period_of_one_day() -> None:
    lstm = _trained()
    history = _series(2 * PERIOD)
    at_0 = lstm.predict(history, 0, HORIZON)
    np.testing.assert_allclose(lstm.predict(history, PERIOD, HORIZON), at_0, rtol=1e-6)  # a day later: the same
    assert not np.allclose(lstm.predict(history, 2, HORIZON), at_0)  # two buckets later in the day: not


def test_same_time_yesterday_with_exactly_one_day_of_history() -> None:
    day = np.array([5.0, 6.0, 7.0])
    assert SameTimeYesterday(3).predict(day, 0, 2).tolist() == [5.0, 6.0]
