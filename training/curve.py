"""The learning curve: held-out acceptance length against training tokens.

``training_log.json`` (written by ``python -m training`` at every save) holds one row
per progress line; this draws it as a PNG when matplotlib is installed:

    python -m training.curve RUN/training_log.json [--out RUN/learning_curve.png]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger("training")
_told_no_matplotlib: list[bool] = []  # say it once per process, not at every save


def plot_curve(log: dict, out: str | Path) -> Path | None:
    """Draw ``log["curve"]`` into ``out``; None (and a message) without matplotlib
    or without rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if _told_no_matplotlib:
            return None
        _told_no_matplotlib.append(True)
        logger.info("matplotlib is not installed: no %s (the curve is in "
                    "training_log.json; `pip install matplotlib`, then "
                    "`python -m training.curve`)", Path(out).name)
        return None
    rows = log.get("curve") or []
    if not rows:
        logger.info("no progress rows yet: no %s", Path(out).name)
        return None
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if any("accept" in r for r in rows):
        held = [(r["tokens"], r["accept"]) for r in rows if "accept" in r]
        ax.plot(*zip(*held), marker="o", markersize=3, label="held-out")
    ax.plot(tokens, [r["train_accept"] for r in rows], alpha=0.5, label="training batches")
    ax.set_xlabel("training tokens (sequence tokens the batches covered)")
    ax.set_ylabel("predicted acceptance length (greedy chain)")
    s = log.get("settings", {})
    name = Path(s["target"]).name if s.get("target") else s.get("preset") or "target"
    ax.set_title(f"{name}: block {s.get('block_size')}, "
                 f"{s.get('drafter_layers')} layer(s)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="a run's training_log.json")
    parser.add_argument("--out", help="PNG to write (default: learning_curve.png beside it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or Path(args.log).with_name("learning_curve.png")
    written = plot_curve(json.loads(Path(args.log).read_text()), out)
    if written:
        print(written)
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
