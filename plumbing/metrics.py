"""The numbers a training step logs, beside the ones the algorithm functions return: phase timings, the
engine-vs-trainer log-prob gap, reward and length statistics, peak memory, and the console's step line.

Every statistic is reduced over all ranks in one collective per call (fsdp_utils.all_reduce) and stays on
the training device until the loop copies the step's numbers to the host once (fsdp_utils.to_floats).
"""

import resource
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from plumbing.collectives import all_reduce, to_floats


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
    """The engine-vs-trainer gap on the sampled tokens (a stale or mis-synced engine shows up here), the
    entropy proxy and the k1 KL to the reference, over all ranks.

    The entropy proxy is the mean -log p of the sampled tokens under the policy that sampled them (the old
    log-probs); the reference logs it from the log-probs of the update, which differ after the first
    optimizer step of a batch.
    """
    mask, old_logprobs, ref_logprobs = batch.response_mask, batch.old_logprobs, batch.ref_logprobs  # a logprobs.Batch
    diff = (old_logprobs - batch.rollout_logprobs) * mask  # [B, R]
    kl = ((old_logprobs - ref_logprobs) * mask).sum() if ref_logprobs is not None else 0.0
    sums = all_reduce({"tokens": mask.sum(), "gap": diff.abs().sum(), "ratio": (diff.clamp(-20, 20).exp() * mask).sum(),
                       "entropy": (-old_logprobs * mask).sum(), "kl": kl}, mask.device)
    tokens = sums["tokens"]
    return {"rollout/logprob_diff_mean": sums["gap"] / tokens, "rollout/is_ratio_mean": sums["ratio"] / tokens,
            "rollout/logprob_diff_max": all_reduce({"max": diff.abs().max()}, mask.device, dist.ReduceOp.MAX)["max"],
            "actor/entropy_proxy": sums["entropy"] / tokens, "actor/kl_ref": sums["kl"] / tokens}


def score_metrics(prefix: str, groups: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Mean/std of every reward key and response-length stats over all ranks (`groups`: grpo.Group records)."""
    scores = [s for g in groups for s in g.scores]
    responses = [r for g in groups for r in g.responses]
    keys = sorted(scores[0]) if scores else []
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
