"""Collectives of the training loop: dicts of numbers reduced in one call, lists moved to the device in one
copy, device numbers read back in one copy.

They run on the training device: NCCL only moves GPU tensors, so a reduction buffer built on the CPU would
crash there (and pass silently under gloo). Reduced values stay on the device until the loop logs them
(`to_floats`), one host sync per step instead of one per number.
"""

import torch
import torch.distributed as dist


def all_reduce(values: dict[str, float | torch.Tensor], device: torch.device,
               op=dist.ReduceOp.SUM) -> dict[str, torch.Tensor]:
    """Reduce a dict of numbers over all ranks in one collective; the results stay on `device` (0-dim, float64).

    `device` is the training device: NCCL needs its buffers there. Example, 2 ranks, SUM:
    {"tokens": 3, "loss": tensor(1.5)} and {"tokens": 5, "loss": tensor(0.5)} -> {"tokens": 8., "loss": 2.}
    """
    buffer = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values.values()])
    dist.all_reduce(buffer, op=op)
    return dict(zip(values, buffer.unbind()))


def union_over_ranks(names: list[str]) -> list[str]:
    """Every rank's names together, sorted (one object all-gather): the keys of a dict that all ranks reduce, where
    a rank may hold none (a validation set smaller than the world). ["a"] and [] -> ["a"] on both ranks."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return sorted(set().union(*gathered))


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's sum over all ranks, in float64 on the tensor's own device (REINFORCE++'s global whitening)."""
    summed = tensor.detach().to(torch.float64)
    dist.all_reduce(summed)
    return summed.to(tensor.dtype)


def quantiles_over_ranks(values: torch.Tensor, valid: torch.Tensor, qs: list[float], points: int = 1024
                         ) -> torch.Tensor:
    """Quantiles `qs` of the valid entries of `values` over all ranks, with no host sync: each rank's valid values,
    sorted, at `points` evenly spaced places (its sketch) are gathered, each point weighing its rank's count / points,
    and read as one distribution: the smallest point whose cumulative weight reaches q (exact on one rank up to the
    sketch's spacing). One rank, values [4, 1, 3, 2], qs [0.5] -> 2."""
    count = valid.sum()
    ordered = torch.where(valid, values, torch.inf).flatten().sort().values  # the valid ones first
    places = (torch.linspace(0, 1, points, device=values.device) * (count - 1).clamp(min=0)).round().long()
    own = torch.cat([ordered[places], count[None]]).to(torch.float64)  # [points + 1]: the sketch, the count
    gathered = [torch.empty_like(own) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, own)
    sketches = torch.stack(gathered)  # [world, points + 1]
    pooled, weights = sketches[:, :-1].flatten(), sketches[:, -1:].expand(-1, points).flatten()
    order = pooled.argsort()
    cumulative = weights[order].cumsum(0) / weights.sum().clamp(min=1)
    picks = torch.stack([torch.searchsorted(cumulative, q) for q in qs])  # a scalar each: no list copied to the GPU
    return pooled[order][picks.clamp(max=len(pooled) - 1)].to(values.dtype)


def to_device(values: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Lists of ints made int64 tensors on `device` in one host-to-device copy: concatenated on the host, pinned and
    sent without waiting (on a GPU), split there. A `torch.tensor(list, device=cuda)` per list would wait for the
    GPU to finish everything queued, each time. {"a": [1, 2], "b": [3]} -> {"a": tensor([1, 2]), "b": tensor([3])}."""
    flat = torch.tensor([v for vs in values.values() for v in vs], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory()
    return dict(zip(values, flat.to(device, non_blocking=True).split([len(vs) for vs in values.values()])))


def to_floats(metrics: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Device numbers -> Python floats with one device-to-host copy (each `.item()` would wait on the GPU)."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    on_host = (dict(zip(tensors, torch.stack([v.to(torch.float64) for v in tensors.values()]).tolist()))
               if tensors else {})
    return {k: on_host[k] if k in on_host else float(v) for k, v in metrics.items()}
