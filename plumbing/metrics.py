"""The numbers a training step logs, beside the ones the algorithm functions return: phase timings, the
engine-vs-trainer log-prob gap, reward and length statistics, pass@k, the rollout correction's weights, peak
memory (the console's step line is plumbing/console.py's).

Every statistic is reduced over all ranks in one collective per call (plumbing/collectives.py all_reduce) and
stays on the training device until the loop copies the step's numbers to the host once (collectives.to_floats).
"""

import math
import resource
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from plumbing.collectives import all_reduce, quantiles_over_ranks, to_floats, union_over_ranks


class PhaseTimer:
    """Seconds per phase of a step, as `timing/<phase>` metrics; GPU work is waited for at each phase's end.

        with timer("update"): ...     # adds to timing/update (a phase entered twice adds up)
    """

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        key = f"timing/{phase}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start


def logprob_metrics(batch) -> dict[str, torch.Tensor]:
    """The engine-vs-trainer gap on the sampled tokens (a stale or mis-synced engine shows up here), with an
    estimate of KL(engine || trainer) per token (k3 on the engine's samples: r - 1 - log r, r = pi_old / mu), the
    entropy proxy and the k1 KL to the reference, over all ranks.

    The entropy proxy is the mean -log p of the sampled tokens under the policy that sampled them (the old
    log-probs); the reference logs it from the log-probs of the update, which differ after the first
    optimizer step of a batch.
    """
    mask, old_logprobs, ref_logprobs = batch.response_mask, batch.old_logprobs, batch.ref_logprobs  # a logprobs.Batch
    diff = (old_logprobs - batch.rollout_logprobs) * mask  # [B, R]
    kl = ((old_logprobs - ref_logprobs) * mask).sum() if ref_logprobs is not None else 0.0
    ratio = diff.clamp(-20, 20).exp()
    sums = all_reduce({"tokens": mask.sum(), "gap": diff.abs().sum(), "ratio": (ratio * mask).sum(),
                       "engine_kl": ((ratio - 1 - diff) * mask).sum(), "entropy": (-old_logprobs * mask).sum(),
                       "kl": kl}, mask.device)
    tokens = sums["tokens"]
    return {"rollout/logprob_diff_mean": sums["gap"] / tokens, "rollout/is_ratio_mean": sums["ratio"] / tokens,
            "rollout/kl_engine_trainer": sums["engine_kl"] / tokens,
            "rollout/logprob_diff_max": all_reduce({"max": diff.abs().max()}, mask.device, dist.ReduceOp.MAX)["max"],
            "actor/entropy_proxy": sums["entropy"] / tokens, "actor/kl_ref": sums["kl"] / tokens}


def correction_metrics(batch, cap: float | None) -> dict[str, torch.Tensor]:
    """The rollout correction's weights (a logprobs.Batch's rollout_weights) on the valid response tokens of all
    ranks: mean, min, max and 5th/50th/95th percentiles; the shares of tokens and of sequences it masked out
    (weight 0) and, for a truncating mode (`cap`: its C), of tokens whose weight it cut to C."""
    weights, mask = batch.rollout_weights, batch.response_mask
    valid, device = mask > 0, mask.device
    rows, kept_rows = valid.any(-1), ((weights > 0) & valid).any(-1)
    sums = all_reduce({"tokens": mask.sum(), "weight": (weights * mask).sum(), "masked": ((weights == 0) & valid).sum(),
                       "truncated": ((weights == cap) & valid).sum() if cap else 0, "sequences": rows.sum(),
                       "masked_sequences": (rows & ~kept_rows).sum()}, device)
    low = all_reduce({"min": torch.where(valid, weights, torch.inf).min()}, device, dist.ReduceOp.MIN)["min"]
    high = all_reduce({"max": torch.where(valid, weights, -torch.inf).max()}, device, dist.ReduceOp.MAX)["max"]
    p05, p50, p95 = quantiles_over_ranks(weights, valid, [0.05, 0.5, 0.95]).unbind()
    tokens = sums["tokens"].clamp(min=1)
    metrics = {"rollout/correction_weight_mean": sums["weight"] / tokens, "rollout/correction_weight_min": low,
               "rollout/correction_weight_max": high, "rollout/correction_weight_p05": p05,
               "rollout/correction_weight_p50": p50, "rollout/correction_weight_p95": p95,
               "rollout/correction_masked_tokens": sums["masked"] / tokens,
               "rollout/correction_masked_sequences": sums["masked_sequences"] / sums["sequences"].clamp(min=1)}
    if cap:
        metrics["rollout/correction_truncated_tokens"] = sums["truncated"] / tokens
    return metrics


def lag_metrics(responses: list, version: int, device: torch.device) -> dict[str, torch.Tensor]:
    """How many weights versions the trainer at `version` is ahead of the ones that sampled `responses` (each its
    oldest token's, rollout.Response.version), over all ranks: async/lag_mean and async/lag_max."""
    lags = [version - r.version for r in responses]
    totals = all_reduce({"lag": sum(lags), "samples": len(lags)}, device)
    return {"async/lag_mean": totals["lag"] / totals["samples"].clamp(min=1),
            "async/lag_max": all_reduce({"max": max(lags, default=0)}, device, dist.ReduceOp.MAX)["max"]}


def score_metrics(prefix: str, groups: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Mean/std of every reward key and response-length stats over all ranks (`groups`: rewards.Group records)."""
    scores = [s for g in groups for s in g.scores]
    responses = [r for g in groups for r in g.responses]
    keys = union_over_ranks(list(scores[0]) if scores else [])  # a rank without samples reduces the same keys
    lengths = [len(r.token_ids) for r in responses]
    sums = {"count": len(scores), "length": sum(lengths), "truncated": sum(r.truncated for r in responses)}
    for key in keys:  # prefixed: a reward key may be called "length" too
        sums[f"reward {key}"], sums[f"reward {key}^2"] = sum(s[key] for s in scores), sum(s[key] ** 2 for s in scores)
    totals = all_reduce(sums, device)
    count = totals["count"].clamp(min=1)
    max_length = all_reduce({"max": max(lengths, default=0)}, device, dist.ReduceOp.MAX)["max"]
    metrics = {f"{prefix}/response_length_mean": totals["length"] / count,
               f"{prefix}/clip_ratio": totals["truncated"] / count,
               f"{prefix}/response_length_max": max_length}
    for key in keys:
        mean = totals[f"reward {key}"] / count
        metrics[f"{prefix}/reward_{key}"] = mean
        metrics[f"{prefix}/reward_{key}_std"] = (totals[f"reward {key}^2"] / count - mean**2).clamp(min=0).sqrt()
    return metrics


PASS_SCORE = 1.0  # a sample passes a reward key when it scores at least this on it (accuracy-like keys are 0 or 1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): of a prompt's n samples, c pass; the chance that k of them, drawn without
    replacement, hold at least one that passes: 1 - C(n - c, k) / C(n, k). The share of prompts whose first k samples
    hold a pass estimates the same number with a higher variance.

    n 4, c 1: pass@1 = 1 - C(3, 1) / C(4, 1) = 0.25, pass@2 = 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5, pass@4 = 1.
    """
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_metrics(prefix: str, groups: list, device: torch.device) -> dict[str, torch.Tensor]:
    """pass@k of every reward key for k = 1, 2, 4, ... up to the samples per prompt, the mean over all ranks'
    prompts, and the half-width of its 95% interval over prompts (normal approximation: 1.96 x the standard error):
    `{prefix}/pass@{k}/{key}` and `{prefix}/pass@{k}/{key}_ci95` (`groups`: rewards.Group records, each prompt's n
    samples scored). mean@n is `{prefix}/reward_{key}` (score_metrics).

    Two prompts of 4 samples with 1 and 3 passing: pass@2 = (0.5 + 1.0) / 2 = 0.75; the values' standard deviation
    0.354 (n - 1 in the denominator) over sqrt(2) prompts, times 1.96: +- 0.49.
    """
    n = min((len(g.scores) for g in groups), default=2**30)  # a rank without prompts leaves n to the others
    n = int(all_reduce({"n": n}, device, dist.ReduceOp.MIN)["n"])
    keys = union_over_ranks(list(groups[0].scores[0]) if groups else [])
    sums = {"prompts": len(groups)}
    for key in keys:
        passed = [sum(s[key] >= PASS_SCORE for s in g.scores[:n]) for g in groups]
        for k in (2**i for i in range(n.bit_length())):
            values = [pass_at_k(n, c, k) for c in passed]
            sums[f"{k} {key}"], sums[f"{k} {key}^2"] = sum(values), sum(v * v for v in values)
    totals = all_reduce(sums, device)
    prompts = totals.pop("prompts").clamp(min=1)
    metrics = {}
    for name in [name for name in totals if not name.endswith("^2")]:
        k, key = name.split(" ", 1)
        mean = totals[name] / prompts
        variance = (totals[f"{name}^2"] - prompts * mean**2).clamp(min=0) / (prompts - 1).clamp(min=1)
        metrics[f"{prefix}/pass@{k}/{key}"] = mean
        metrics[f"{prefix}/pass@{k}/{key}_ci95"] = 1.96 * (variance / prompts).sqrt()
    return metrics


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak memory, GiB: on a GPU what tensors held (`perf/peak_memory_gib`) and what the allocator
    reserved for them (`perf/peak_memory_reserved_gib`: its cache included, what sizing a run needs); on a CPU the
    process's peak resident memory."""
    if device.type == "cuda":
        return {"perf/peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "perf/peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {"perf/peak_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # Linux reports KiB


def step_totals(metrics: dict, timer: PhaseTimer, tokens: int, device: torch.device) -> dict[str, float]:
    """A step's metrics with its phase timings, its throughput (`tokens`: this rank's prompt and response tokens)
    and the peak memory of any rank, copied to the host: the one device-to-host copy of the step's numbers."""
    step_time = sum(timer.seconds.values())
    tokens = all_reduce({"tokens": tokens}, device)["tokens"]
    return to_floats({**metrics, **timer.seconds, "timing/step": step_time, "perf/tokens_per_s": tokens / step_time,
                      **all_reduce(peak_memory(device), device, dist.ReduceOp.MAX)})
