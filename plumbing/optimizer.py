"""The optimizer and its learning-rate schedule: AdamW with fp32 or bf16 moments; warm-up, then constant or cosine.

    optimizer = build_optimizer(model.parameters(), "adamw_bf16", lr=1e-6, betas=(0.9, 0.999), weight_decay=1e-2)
    scheduler = build_scheduler(optimizer, warmup_steps, "cosine", min_lr_ratio=0.1, total_steps=total_steps)

Design decisions:
- `adamw` is torch's AdamW: its moments have the parameters' dtype (fp32 master weights: 8 bytes of state
  per parameter).
- `adamw_bf16` (the reference's option of that name) stores both moments in bf16, half the state memory
  (4 bytes per parameter), and does the arithmetic of each update in fp32: the moments are read up to fp32,
  updated, and rounded back; the parameter is updated in fp32 and written in its own dtype. With fp32
  parameters only the moments are rounded (relative error ~2^-8 per step, which AdamW's normalisation keeps
  from adding up); bf16 parameters (`--actor.dtype bfloat16`) are written with stochastic rounding
  (stochastic_bf16). Rounded to the nearest bf16 instead, an update below half a weight's bf16 step is lost: at
  lr 1e-6 every weight above ~2.4e-4 and every norm weight (~1.0), about 98% of a model's weights, would never
  move while the losses look normal (tests/test_optimizer.py measures it). torch's AdamW on bf16 parameters
  rounds so; the config check refuses that pair.
- Under FSDP2 the parameters and moments are sharded DTensors; the update works on each rank's local shard,
  elementwise, so it needs no communication, and the moments stay DTensors so distributed checkpoints save
  and reshard them like torch's.
"""

import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stochastic_bf16(values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 `values` rounded to a neighbouring bf16 at random, the nearer one the likelier, so that the expected
    result is the value itself: an update far below a weight's bf16 step still moves it on average. bf16 is the
    top 16 bits of fp32: add 16 random low bits, then cut them. Example: 1 + 2^-9, a quarter of bf16's step of
    2^-7 above 1, becomes 1 + 2^-7 with chance 1/4, else 1."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator)
    return ((values.contiguous().view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamWBF16States(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with moments stored in bf16, computed in fp32.

    One step with gradient g, step t, moments m and v:
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    the same formula as torch.optim.AdamW; example, first step with g = 0.1, lr 0.1, no decay: m/(1 - b1) = 0.1,
    sqrt(v/(1 - b2)) = 0.1, so p moves by -0.1 (eps aside). A bf16 parameter is written with stochastic rounding,
    its random bits drawn from a generator seeded by the step, the parameter's place and the rank (a resumed run on
    as many ranks draws the same ones).
    """

    state_dtype = torch.bfloat16  # the moments' storage; the arithmetic is fp32 whatever it is

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor to its parameter's dtype (fp32 moments after a resume,
        unrounded from then on: a resumed run would drift from the straight one); cast the moments back."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        # each rank's shards their own bits: the same draw at the same offset of every shard would round
        # weights of the same local place alike (correlated)
        rank = dist.get_rank() if dist.is_initialized() else 0
        for number, group in enumerate(self.param_groups):
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # the step count on the host, as torch's AdamW keeps it (no GPU sync to read it)
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
                state["step"] += 1
                step = state["step"].item()
                grad = _local(param.grad).float()
                exp_avg = _local(state["exp_avg"]).float().lerp_(grad, 1 - beta1)
                exp_avg_sq = _local(state["exp_avg_sq"]).float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                _local(state["exp_avg"]).copy_(exp_avg)
                _local(state["exp_avg_sq"]).copy_(exp_avg_sq)
                denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
                weights = _local(param)
                step_size = lr / (1 - beta1**step)
                updated = weights.float().mul_(1 - lr * decay).addcdiv_(exp_avg, denominator, value=-step_size)
                if weights.dtype == torch.bfloat16:  # ints hash alike in every process
                    seed = hash((int(step), number, index, rank))
                    updated = stochastic_bf16(updated, torch.Generator(weights.device).manual_seed(seed))
                weights.copy_(updated)


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adamw_bf16": AdamWBF16States}


def build_optimizer(params: Iterable, name: str, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer called `name` (a key of OPTIMIZERS) over the trainable `params`."""
    return OPTIMIZERS[name]([p for p in params if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, schedule: str, min_lr_ratio: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR scheduler of lr_lambda's factors. A non-finite gradient skips optimizer.step() on purpose
    (grpo.update_policy), so torch's warning about a scheduler step before an optimizer step is silenced."""
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup_steps, schedule, min_lr_ratio, total_steps))


def lr_lambda(warmup_steps: int, schedule: str, min_lr_ratio: float, total_steps: int):
    """The LR factor of each step: linear warm-up over `warmup_steps`, then constant or cosine down to
    `min_lr_ratio`. Example, 2 warm-up steps of 6, cosine to 0.1: [0.5, 1, 1, 0.87, 0.55, 0.23]."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
