"""Forecasting a fleet's load one hour ahead: three simple baselines and a small LSTM, compared by MAE.

A *series* is a zone's requests per bucket (``bucket_s`` seconds, 300 by default), oldest first. Every
forecaster answers the same question: given the series up to bucket t (inclusive), the next ``horizon``
buckets' values. Formulas (h = 1..H):

* ``last_value``:   x̂(t+h) = x(t)
* ``same_time_yesterday``: x̂(t+h) = x(t+h−P), P = buckets per day (falls back to last value without a day)
* ``moving_average``: x̂(t+h) = mean(x(t−W+1..t)), W = one hour of buckets
* ``lstm``: a one-layer LSTM over the last L buckets (scaled by the training mean) and the time of day
  (sin, cos), whose last hidden state is mapped linearly to the H next values; trained with Adam on MSE.

:func:`compare` scores each on a held-out tail (MAE over every forecast origin there and every horizon
step) and names the one to trust: the LSTM only when it beats the best baseline. Pure apart from torch's
own computation; the LSTM is seeded, so a run is reproducible on one machine.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


def _torch() -> Any:
    """torch, on one thread: the model is tiny, and torch's default of one thread per core only adds
    spin-waiting when the planner shares its cores (measured: 200 epochs 41 s on 2 threads of a busy 2-core
    machine, 5.6 s on 1)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    return torch


class Forecaster(Protocol):
    """Something that forecasts the next ``horizon`` buckets of a series."""

    name: str

    def fit(self, series: np.ndarray, start_bucket: int) -> None: ...

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray: ...


@dataclass
class LastValue:
    """x̂(t+h) = x(t)."""

    name: str = "last_value"

    def fit(self, series: np.ndarray, start_bucket: int) -> None:
        return None

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        return np.full(horizon, float(history[-1]) if history.size else 0.0)


@dataclass
class SameTimeYesterday:
    """x̂(t+h) = x(t+h−P), P buckets per day; the last value where the history is shorter than a day."""

    period: int
    name: str = "same_time_yesterday"

    def fit(self, series: np.ndarray, start_bucket: int) -> None:
        return None

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        n = history.size
        if n < self.period:
            return LastValue().predict(history, start_bucket, horizon)
        idx = np.arange(n, n + horizon) - self.period
        return history[np.minimum(idx, n - 1)].astype(float)


@dataclass
class MovingAverage:
    """x̂(t+h) = mean of the last ``window`` values."""

    window: int
    name: str = "moving_average"

    def fit(self, series: np.ndarray, start_bucket: int) -> None:
        return None

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        tail = history[-self.window :]
        return np.full(horizon, float(tail.mean()) if tail.size else 0.0)


@dataclass
class LstmForecaster:
    """A one-layer LSTM: L buckets of (scaled load, sin, cos of the time of day) → the next H values.

    ``period`` is buckets per day (the time-of-day feature); ``scale`` (the training series' mean) is learnt
    by :meth:`fit` and kept in the checkpoint with the weights.
    """

    period: int
    lookback: int = 24
    horizon: int = 12
    hidden: int = 32
    epochs: int = 150
    lr: float = 0.01
    seed: int = 0
    name: str = "lstm"
    scale: float = 1.0
    _model: Any = field(default=None, repr=False)

    def _features(self, values: np.ndarray, first_bucket: int) -> np.ndarray:
        phase = 2 * math.pi * (np.arange(first_bucket, first_bucket + values.size) % self.period) / self.period
        return np.stack([values / self.scale, np.sin(phase), np.cos(phase)], axis=1).astype(np.float32)

    def _build(self) -> Any:
        torch = _torch()
        module: Any = torch.nn.Module

        class Net(module):  # type: ignore[misc]
            def __init__(self, hidden: int, horizon: int) -> None:
                super().__init__()
                self.lstm = torch.nn.LSTM(3, hidden, batch_first=True)
                self.head = torch.nn.Linear(hidden, horizon)

            def forward(self, x: Any) -> Any:
                out, _ = self.lstm(x)
                return self.head(out[:, -1, :])  # type: ignore[no-any-return]

        return Net(self.hidden, self.horizon)

    def fit(self, series: np.ndarray, start_bucket: int) -> None:
        """Trains on every (L inputs → H targets) window of ``series`` (full batch, ``epochs`` Adam steps)."""
        torch = _torch()

        n_windows = series.size - self.lookback - self.horizon + 1
        if n_windows < 1:
            raise ValueError(f"series of {series.size} buckets is shorter than lookback + horizon")
        torch.manual_seed(self.seed)
        self.scale = max(float(series.mean()), 1e-9)
        feats = self._features(series.astype(float), start_bucket)
        x = np.stack([feats[i : i + self.lookback] for i in range(n_windows)])
        y = np.stack([series[i + self.lookback : i + self.lookback + self.horizon] for i in range(n_windows)])
        xt = torch.from_numpy(x)
        yt = torch.from_numpy((y / self.scale).astype(np.float32))
        model = self._build()
        opt = torch.optim.Adam(model.parameters(), lr=self.lr)
        for _ in range(self.epochs):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xt), yt)
            loss.backward()
            opt.step()
        self._model = model.eval()

    def predict(self, history: np.ndarray, start_bucket: int, horizon: int) -> np.ndarray:
        torch = _torch()
        if self._model is None:
            raise RuntimeError("LstmForecaster.predict before fit or load")
        if horizon > self.horizon:
            raise ValueError(f"horizon {horizon} > the trained horizon {self.horizon}")
        if history.size < self.lookback:
            return LastValue().predict(history, start_bucket, horizon)
        first = start_bucket + history.size - self.lookback
        x = torch.from_numpy(self._features(history[-self.lookback :].astype(float), first)[None])
        with torch.no_grad():
            y = self._model(x)[0].numpy().astype(float) * self.scale
        return np.maximum(y[:horizon], 0.0)

    def checkpoint(self) -> bytes:
        """The trained model and its scale, as bytes (``torch.save``); :meth:`load` reads them back."""
        torch = _torch()

        if self._model is None:
            raise RuntimeError("nothing to checkpoint: the LSTM is not trained")
        buf = io.BytesIO()
        torch.save({"scale": self.scale, "state": self._model.state_dict()}, buf)
        return buf.getvalue()

    def load(self, data: bytes) -> None:
        torch = _torch()

        saved = torch.load(io.BytesIO(data), weights_only=True)
        model = self._build()
        model.load_state_dict(saved["state"])
        self.scale = float(saved["scale"])
        self._model = model.eval()


def baselines(period: int, hour_buckets: int) -> list[Forecaster]:
    """The three simple baselines, for a series with ``period`` buckets per day and ``hour_buckets`` per hour."""
    return [LastValue(), SameTimeYesterday(period), MovingAverage(hour_buckets)]


def mae(forecaster: Forecaster, series: np.ndarray, test_from: int, horizon: int) -> float:
    """Mean absolute error of ``forecaster`` over every origin t ≥ ``test_from`` − 1 with H values after it."""
    errors: list[float] = []
    for t in range(test_from, series.size - horizon + 1):
        pred = forecaster.predict(series[:t], 0, horizon)
        errors.extend(np.abs(pred - series[t : t + horizon]).tolist())
    if not errors:
        raise ValueError("no forecast origin in the held-out part: it is shorter than the horizon")
    return float(np.mean(errors))


@dataclass(frozen=True)
class Comparison:
    """Held-out MAE of the LSTM and of each baseline, and the forecaster the planner trusts."""

    lstm_mae: float
    baselines: dict[str, float]
    chosen: str

    def to_json(self) -> dict[str, Any]:
        return {
            "lstm_mae": round(self.lstm_mae, 4),
            "baselines": {k: round(v, 4) for k, v in self.baselines.items()},
            "chosen": self.chosen,
        }


def compare(
    series: Sequence[float] | np.ndarray, test_from: int, period: int, hour_buckets: int, lstm: LstmForecaster
) -> Comparison:
    """Fits ``lstm`` on ``series[:test_from]``, scores it and the baselines on the rest; the LSTM is chosen
    only when its MAE is below every baseline's."""
    s = np.asarray(series, dtype=float)
    if not 0 < test_from < s.size:
        raise ValueError(f"test_from {test_from} must split the {s.size}-bucket series")
    lstm.fit(s[:test_from], 0)
    base = {f.name: mae(f, s, test_from, lstm.horizon) for f in baselines(period, hour_buckets)}
    lstm_err = mae(lstm, s, test_from, lstm.horizon)
    best = min(base, key=lambda k: base[k])
    return Comparison(lstm_err, base, "lstm" if lstm_err < base[best] else best)


def forecaster_named(name: str, period: int, hour_buckets: int, lstm: LstmForecaster) -> Forecaster:
    """The forecaster called ``name`` (``lstm`` or a baseline's name)."""
    if name == lstm.name:
        return lstm
    for f in baselines(period, hour_buckets):
        if f.name == name:
            return f
    raise ValueError(f"unknown forecaster {name!r}")
