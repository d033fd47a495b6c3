"""scripts/plot.py: what is read from metrics.jsonl, what is drawn from it, the PNG the command writes, clear errors."""

import json
import re
import subprocess
import sys

import matplotlib.image
import pytest

import scripts.plot as plot
from conftest import ROOT

# Validation before training (step 0), validation on steps 2 and 4, and step 3 logged twice: the second wins.
LINES = [
    {"step": 0, "val/reward_overall": 0.1},
    {"step": 1, "train/reward_overall": 0.2, "actor/kl_ref": 0.001, "train/response_length_mean": 50.0,
     "rollout/logprob_diff_mean": 1e-5},
    {"step": 2, "train/reward_overall": 0.3, "actor/kl_ref": 0.002, "train/response_length_mean": 60.0,
     "rollout/logprob_diff_mean": 2e-5, "val/reward_overall": 0.25},
    {"step": 3, "train/reward_overall": 0.9, "actor/kl_ref": 0.9, "train/response_length_mean": 900.0,
     "rollout/logprob_diff_mean": 0.9},
    {"step": 3, "train/reward_overall": 0.4, "actor/kl_ref": 0.003, "train/response_length_mean": 70.0,
     "rollout/logprob_diff_mean": 3e-4},
    {"step": 4, "train/reward_overall": 0.5, "actor/kl_ref": 0.004, "train/response_length_mean": 80.0,
     "rollout/logprob_diff_mean": 4e-3, "val/reward_overall": 0.45},
]


def write_run(tmp_path, lines, name="my-run"):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "scripts.plot", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_read_metrics_keeps_the_last_line_of_a_step_and_step_0_validation(tmp_path):
    series = plot.read_metrics(write_run(tmp_path, LINES) / "metrics.jsonl")
    assert series == {
        "train/reward_overall": [(1, 0.2), (2, 0.3), (3, 0.4), (4, 0.5)],
        "actor/kl_ref": [(1, 0.001), (2, 0.002), (3, 0.003), (4, 0.004)],
        "train/response_length_mean": [(1, 50.0), (2, 60.0), (3, 70.0), (4, 80.0)],
        "rollout/logprob_diff_mean": [(1, 1e-5), (2, 2e-5), (3, 3e-4), (4, 4e-3)],
        "val/reward_overall": [(0, 0.1), (2, 0.25), (4, 0.45)],
    }


def test_panels_draw_the_read_data_and_name_a_missing_key(tmp_path, monkeypatch):
    lines = [{k: v for k, v in line.items() if k != "actor/kl_ref"} for line in LINES]  # an older run: no KL
    run = write_run(tmp_path, lines)
    figures = []
    monkeypatch.setattr(plot.plt, "close", figures.append)  # keep the figure main() draws to look inside it
    plot.main(run)
    reward, kl, length, gap = figures[0].axes
    train, val = reward.get_lines()
    assert train.get_xydata().tolist() == [[1, 0.2], [2, 0.3], [3, 0.4], [4, 0.5]]
    assert val.get_xydata().tolist() == [[0, 0.1], [2, 0.25], [4, 0.45]]
    assert val.get_linestyle() == "None" and val.get_marker() == "o"  # validation as markers, not a line
    assert kl.get_lines() == [] and [t.get_text() for t in kl.texts] == ["no actor/kl_ref in metrics.jsonl"]
    assert length.get_lines()[0].get_xydata().tolist() == [[1, 50], [2, 60], [3, 70], [4, 80]]
    assert gap.get_yscale() == "log" and reward.get_yscale() == "linear"
    assert figures[0].get_suptitle() == "my-run"


@pytest.mark.slow
def test_command_writes_a_png_of_the_figure_size(tmp_path):
    run = write_run(tmp_path, LINES)
    proc = run_plot(run)
    assert proc.returncode == 0, proc.stderr
    png = run / "curves.png"
    assert proc.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = (inches * plot.DPI for inches in plot.FIGSIZE)
    assert matplotlib.image.imread(png).shape[:2] == (height, width)

    out = tmp_path / "elsewhere.png"
    assert run_plot(run, "--out", out).stdout.strip() == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_missing_run_folder_names_the_path_and_the_logger_flag(tmp_path):
    proc = run_plot(tmp_path / "no-such-run")
    assert proc.returncode != 0
    assert str(tmp_path / "no-such-run" / "metrics.jsonl") in proc.stderr and "--trainer.logger" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_malformed_line_names_the_file_and_line(tmp_path):
    run = write_run(tmp_path, LINES[:3])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/rew')  # a run killed mid-write
    proc = run_plot(run)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"{run / 'metrics.jsonl'}: line 4 " in proc.stderr
    assert not (run / "curves.png").exists()


@pytest.mark.parametrize("text, line", [("", 1), ('{"step": 1}\n{"train/reward_overall": 0.5}\n', 2),
                                        ('{"step": 1, "train/reward_overall": "high"}\n', 1), ("\n[1, 2]\n", 2)])
def test_empty_file_and_bad_records_name_the_line(tmp_path, text, line):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit, match=rf"^{re.escape(str(path))}: line {line}\b"):
        plot.read_metrics(path)
