"""Unbiased pass@k (plumbing/metrics.py): the estimator against hand-computed values and against counting every
subset, and the validation metrics over the prompts of all ranks with their interval, by hand."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from plumbing.metrics import PASS_SCORE, pass_at_k, pass_metrics


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25),           # 1 - C(3, 1) / C(4, 1) = 1 - 3/4
    (4, 1, 2, 0.5),            # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
    (4, 2, 2, 5 / 6),          # 1 - C(2, 2) / C(4, 2) = 1 - 1/6
    (8, 1, 4, 0.5),            # 1 - C(7, 4) / C(8, 4) = 1 - 35/70
    (8, 3, 2, 1 - 10 / 28),    # 1 - C(5, 2) / C(8, 2)
    (4, 0, 4, 0.0),            # nothing passes
    (4, 3, 2, 1.0),            # fewer failures than draws: a pass is always among them
    (16, 16, 1, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    """Worked values of 1 - C(n - c, k) / C(n, k), the edges (c = 0, n - c < k) included."""
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass():
    """Counting every k-subset of n samples (c of them passing) gives the estimator exactly, for every n <= 7."""
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets)), (n, c, k)


def test_the_first_k_samples_estimate_pass_at_k_only_on_average():
    """The biased reading (did the first k samples pass?) depends on the order of the samples; the estimator does
    not: over every order it averages to pass@k."""
    samples = [True, False, False, False]
    orders = set(itertools.permutations(samples))
    first_two = [any(order[:2]) for order in orders]
    assert set(first_two) == {True, False}  # 0 or 1, depending on the order
    assert sum(first_two) / len(first_two) == pytest.approx(pass_at_k(4, 1, 2))


def group(*values: float, key: str = "accuracy") -> SimpleNamespace:
    return SimpleNamespace(scores=[{key: v, "overall": v / 2} for v in values])


def test_pass_metrics_over_prompts_with_their_interval(world_of_one):
    """Two prompts of 4 samples, 1 and 3 passing: pass@1 = (0.25 + 0.75) / 2, pass@2 = (0.5 + 1) / 2, pass@4 = 1,
    each with 1.96 x the standard error over the prompts; scores under PASS_SCORE do not pass (`overall`: 0.5)."""
    groups = [group(1, 0, 0, 0), group(1, 1, 0.99, 1)]
    metrics = {k: v.item() for k, v in pass_metrics("val", groups, torch.device("cpu")).items()}
    assert sorted(metrics) == sorted(f"val/pass@{k}/{key}{ci}" for k in (1, 2, 4) for key in ("accuracy", "overall")
                                     for ci in ("", "_ci95"))
    for k, values in {1: [0.25, 0.75], 2: [0.5, 1.0], 4: [1.0, 1.0]}.items():
        mean = sum(values) / 2
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (2 - 1))
        assert metrics[f"val/pass@{k}/accuracy"] == pytest.approx(mean)
        assert metrics[f"val/pass@{k}/accuracy_ci95"] == pytest.approx(1.96 * std / math.sqrt(2), abs=1e-6)
        assert metrics[f"val/pass@{k}/overall"] == 0.0 and metrics[f"val/pass@{k}/overall_ci95"] == 0.0
    assert PASS_SCORE == 1.0


def test_pass_metrics_go_up_to_the_largest_power_of_two_within_n(world_of_one):
    """Six samples a prompt: pass@1, @2 and @4 (8 > 6); one sample: pass@1 only, the share of prompts that pass."""
    six = pass_metrics("val", [group(1, 0, 0, 0, 0, 0)], torch.device("cpu"))
    assert sorted(k for k in six if k.endswith("/accuracy")) == [f"val/pass@{k}/accuracy" for k in (1, 2, 4)]
    assert six["val/pass@4/accuracy"].item() == pytest.approx(1 - math.comb(5, 4) / math.comb(6, 4))
    one = pass_metrics("val", [group(1), group(0), group(1)], torch.device("cpu"))
    assert sorted(k for k in one if k.endswith("/accuracy")) == ["val/pass@1/accuracy"]
    assert one["val/pass@1/accuracy"].item() == pytest.approx(2 / 3)
