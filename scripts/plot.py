"""Plot a run's training curves from its metrics.jsonl, for runs without an experiment tracker.

    python -m scripts.plot runs/tiny-qwen2_toy           # writes runs/tiny-qwen2_toy/curves.png
    python -m scripts.plot runs/tiny-qwen2_toy --out curves.png

One 2x2 figure over the training step, titled with the run folder's name:
    reward (train per step, validation as markers) | KL to the reference model
    response length (mean tokens)                   | trainer-vs-vLLM log-prob gap (log scale)
Design decisions:
- A line of metrics.jsonl is one step's numbers; a step logged twice (a resumed run that replayed it)
  keeps its last line, as that is the one the run continued from. Validation before training is step 0.
- A metric missing from the file (an older run, or validation switched off) is said in its panel, so
  one missing key never costs the other three panels.
- The figure has a fixed pixel size (10x6 inches at 100 dpi, no tight bounding box) and a 64-colour
  palette, so a committed PNG stays small and two runs' pictures line up.
"""

import io
import json
from pathlib import Path
from typing import Annotated

import matplotlib

matplotlib.use("Agg")  # no display on training machines; must precede the pyplot import
import matplotlib.pyplot as plt  # noqa: E402
import tyro  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from PIL import Image  # noqa: E402

# (panel title, metric key, validation key drawn as markers or None, log y axis)
PANELS = (
    ("reward", "train/reward_overall", "val/reward_overall", False),
    ("KL to the reference", "actor/kl_ref", None, False),
    ("response length (tokens)", "train/response_length_mean", None, False),
    ("trainer vs engine log-prob gap", "rollout/logprob_diff_mean", None, True),
)
FIGSIZE, DPI = (10, 6), 100


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl -> {key: [(step, value), ...] by step}; the last line logged for a step wins.

    Lines {"step": 1, "r": 0.5}, {"step": 1, "r": 0.7}, {"step": 0, "v": 0.1} -> {"r": [(1, 0.7)], "v": [(0, 0.1)]}.
    """
    if not path.is_file():
        raise SystemExit(f"{path} not found: a run writes it into its run folder when --trainer.logger "
                         "includes jsonl (the default)")
    rows: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row.pop("step"))
            rows[step] = {key: float(value) for key, value in row.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # not JSON/an object, no step, a non-number
            raise SystemExit(f"{path}: line {number} is not a metrics record ({error!r}): {line[:80]}") from None
    if not rows:
        raise SystemExit(f"{path}: line 1: the file is empty, no metrics to plot")
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            series.setdefault(key, []).append((step, value))
    return series


def main(run_dir: Annotated[Path, tyro.conf.Positional], out: Path | None = None) -> Path:
    """Plot RUN_DIR/metrics.jsonl into a PNG and print its path.

    Args:
        run_dir: Run folder (output_dir/experiment_name of the training run).
        out: PNG to write; default RUN_DIR/curves.png.
    """
    series = read_metrics(run_dir / "metrics.jsonl")
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=DPI, sharex=True)
    for ax, (title, key, val_key, log) in zip(axes.flat, PANELS):
        ax.set_title(title, fontsize=10)
        if key in series:
            ax.plot(*zip(*series[key]), label=key)
        else:
            ax.text(0.5, 0.5, f"no {key} in metrics.jsonl", transform=ax.transAxes, ha="center", va="center")
        if val_key in series:
            ax.plot(*zip(*series[val_key]), "o", label=val_key)
            ax.legend(fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training step")
    axes[1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by all four; no step 2.5 on short runs
    fig.suptitle(run_dir.resolve().name)
    fig.tight_layout()
    out = save_png(fig, out or run_dir / "curves.png")
    print(out)
    return out


def save_png(fig, out: Path) -> Path:
    """The figure as a PNG of 64 colours (pillow comes with matplotlib): noisy, antialiased curves take a fraction of
    their full-colour size (docs/trackers-and-metrics.md); no bbox_inches="tight": the PNG is exactly the figure's
    size x DPI pixels."""
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    Image.open(png).convert("RGB").quantize(64).save(out, format="png", optimize=True)
    return out


if __name__ == "__main__":
    tyro.cli(main)
