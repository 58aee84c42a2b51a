"""training/curve.py: the learning curve as a PNG, or a message without matplotlib."""

from __future__ import annotations

import logging
import sys

import pytest

from training import curve

LOG = {"settings": {"target": "/x/tiny", "block_size": 4, "drafter_layers": 1},
       "curve": [{"tokens": 100 * i, "accept": 1 + 0.1 * i, "train_accept": 1 + 0.2 * i}
                 for i in range(1, 5)]}


def test_without_matplotlib_says_so_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="training")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    monkeypatch.setattr(curve, "_told_no_matplotlib", [])
    assert curve.plot_curve(LOG, tmp_path / "c.png") is None
    assert curve.plot_curve(LOG, tmp_path / "c.png") is None
    assert caplog.text.count("matplotlib is not installed") == 1
    assert not (tmp_path / "c.png").exists()


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    out = curve.plot_curve(LOG, tmp_path / "c.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
