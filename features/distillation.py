"""On-policy distillation (Agarwal et al. 2024, GKD; the Qwen3 report; Thinking Machines 2025): the
student samples as in RL, a frozen teacher of the same tokenizer scores every token it wrote, and
the student learns towards the teacher's distribution.

    torchrun --nproc_per_node 2 grpo.py toy_distill    # after the default job, its model teaches
    ... --algorithm.adv-estimator distill --distill.teacher PATH --distill.kl forward

Wired into grpo.py by one call, Distillation.start (None without a teacher), which the step then
asks at two points: before the advantages, for what the `distill` estimator gets (the sampled
signal's teacher pass: estimator_inputs), and in the update, for the terms the loss adds at each
token (the whole-vocabulary divergences as a head column of the student's chunks: loss_terms).

Design decisions:
- The teacher's signal is one of three (--distill.kl; docs/algorithms.md compares them). sampled:
  each sampled token's log pi_teacher - log pi_old is its advantage (algorithms.distill_advantages),
  the teacher's log-probs from one no-grad pass of its own (teacher_logprobs). reverse / forward:
  the divergence over the whole vocabulary at every response token, in the loss; the teacher's
  forward runs on each micro-batch of the update, first, and its head in the student's chunks
  (divergence_column), so no [tokens, vocabulary] tensor is kept for either model.
- The config lives here with the rest of the feature, as tools.py's does; grpo.py's Config holds
  it (--distill.*).
"""

from dataclasses import dataclass
from typing import Literal

import torch

from fsdp_utils import load_scorer, reshard
from logprobs import (Batch, HeadChunk, HeadColumn, batched_logprobs, forward_inputs,
                      response_states)
from model.sequence_parallel import SequenceParallel
from plumbing.collectives import sum_over_ranks


@dataclass
class DistillConfig:
    teacher: str = ""
    """On-policy distillation: the teacher model (a folder, hub id or tiny:NAME) with the student's
    tokenizer, frozen and sharded as the reference is; with --algorithm.adv-estimator distill."""
    reward_weight: float = 0.0
    """The weight of GRPO's outcome advantage beside the teacher's signal (0: the teacher alone)."""
    kl: Literal["sampled", "reverse", "forward"] = "sampled"
    """The teacher's signal. sampled: each sampled token's log pi_teacher - log pi_old is its
    advantage (Thinking Machines' recipe: the teacher's log-prob of that token alone, of its raw
    distribution, temperature 1 and the whole vocabulary; pi_old the student's sampling one);
    reverse / forward: KL(student || teacher) / KL(teacher || student) over the whole vocabulary at
    every response token, both at the sampling temperature, added to the loss (GKD's on-policy
    divergences: the teacher's whole distribution in the head's chunks, its forward in the update's
    micro-batches)."""

    @property
    def scores_samples(self) -> bool:
        """A teacher scores the sampled tokens before the update (the sampled signal): the
        advantages need the old log-probs before the update's forward."""
        return bool(self.teacher) and self.kl == "sampled"


@dataclass
class Distillation:
    """A run's teacher (frozen, sharded as the reference is) and its signal."""

    teacher: torch.nn.Module
    cfg: DistillConfig

    @classmethod
    def start(cls, cfg, run, tokenizer) -> "Distillation | None":
        """The teacher of --distill.teacher (grpo.Config `cfg`, grpo.Run `run`: its path resolved,
        the device), refused unless its tokenizer is the student's (load_teacher); None without
        one, and for an evaluation (--trainer.val-only: no update to teach)."""
        if not run.teacher_path or cfg.trainer.val_only:
            return None
        return cls(load_teacher(run.teacher_path, run.device, tokenizer,
                                cfg.actor.fsdp_cpu_offload), cfg.distill)

    def estimator_inputs(self, batch: Batch, passes: dict, timer) -> tuple[dict, dict]:
        """Before the advantages: what the `distill` estimator gets beside the rewards (fields of
        algorithms.AdvantageInputs: the weight of the outcome's advantage and, with the sampled
        signal, the teacher's gap log pi_teacher - log pi_old of each sampled token [B, R], from
        the teacher's pass timed as teacher_logprob), and its metrics (sampled_gap)."""
        inputs = {"reward_weight": self.cfg.reward_weight}
        if self.cfg.kl != "sampled":  # the teacher is in the loss (loss_terms)
            return inputs, {}
        with timer("teacher_logprob"):
            scored = teacher_logprobs(self.teacher, batch, passes)  # [B, R]
        gap, metrics = sampled_gap(scored, batch)
        return {**inputs, "teacher_gap": gap}, metrics

    def loss_terms(self) -> list[HeadColumn]:
        """In the update: the terms the loss adds at each token, here the divergence from the
        teacher over the whole vocabulary (--distill.kl reverse or forward; sampled: none, the
        teacher is in the advantages)."""
        return [] if self.cfg.kl == "sampled" else [divergence_column(self.teacher, self.cfg.kl)]


def load_teacher(path: str, device: torch.device, tokenizer,
                 cpu_offload: bool = False) -> torch.nn.Module:
    """The teacher, which scores the student's own token ids (fsdp_utils.load_scorer: frozen,
    sharded as the reference is): another size of the student's family."""
    return load_scorer(path, device, tokenizer, cpu_offload,
                       f"--distill.teacher {path}: its tokenizer is not the student's, and the "
                       "teacher scores the student's token ids; pick a teacher of the student's "
                       "family (the same tokenizer)")


# ---- the sampled signal --------------------------------------------------------------------------


def teacher_logprobs(teacher, batch: Batch, passes: dict) -> torch.Tensor:
    """The teacher's log-prob of each sampled token [B, R]: logprobs.batched_logprobs with the
    passes' settings (grpo.pass_settings: micro-batches, packing, sequence parallelism) at
    temperature 1, without top-k / top-p, the teacher's raw distribution. It is the model the
    student learns towards, and the sampling's temperature and truncation are the student's
    (tinker-cookbook's train_on_policy.py asks its teacher for compute_logprobs, which takes no
    sampling settings). The teacher's logits [2, 1, 0] and the sampled token the second: raw,
    1 - log(e^2 + e^1 + e^0) = -1.408; at temperature 0.5 it would be 2 - log(e^4 + e^2 + e^0)
    = -2.143, with top-k 2 at temperature 1, 1 - log(e^2 + e^1) = -1.313."""
    return batched_logprobs(teacher, batch, **{**passes, "temperature": 1.0, "top_k": -1,
                                               "top_p": 1.0})


def sampled_gap(teacher_logprobs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict]:
    """The teacher's gap log pi_teacher - log pi_old of each sampled token [B, R], and the
    student's reverse KL to the teacher, its k1 estimate over every rank's sampled tokens
    (distill/reverse_kl: the mean of log pi_old - log pi_teacher; a ratio of two sums, so the N
    ranks of a sequence-parallel group holding the same rows count N times in both)."""
    gap = teacher_logprobs - batch.old_logprobs  # [B, R]
    mask = batch.response_mask
    sums = sum_over_ranks(torch.stack([(-gap * mask).sum(), mask.sum()]))
    return gap, {"distill/reverse_kl": sums[0] / sums[1]}


# ---- the divergences over the whole vocabulary ---------------------------------------------------


def divergence_column(teacher, kl: str) -> HeadColumn:
    """The `kl` divergence (reverse or forward) from the teacher at each response token, a head
    column of the student's chunks logged as distill/{kl}_kl: the teacher's forward on each
    micro-batch first (teacher_states), its head then applied to each chunk's hidden states beside
    the student's (divergence); its root FSDP unit, which holds its head, stays gathered through the
    micro-batches and is resharded after them."""

    def bind(micro: Batch, padding_free: bool, sp: SequenceParallel):
        states = teacher_states(teacher, micro, padding_free, sp)  # [N, H_t]
        return divergence_of(teacher.get_output_embeddings(), states, kl)

    return HeadColumn(f"distill/{kl}_kl", bind, release=lambda: reshard(teacher))


def divergence_of(head: torch.nn.Module, states: torch.Tensor, kl: str):
    """The divergence as a function of each chunk of the head's work (HeadChunk -> [c]), the
    teacher's `head` and its hidden states of the micro-batch's response tokens [N, H_t] cut to the
    chunk's tokens."""
    return lambda chunk: divergence(chunk, head, states[chunk.tokens], kl)


@torch.no_grad()
def teacher_states(teacher, batch: Batch, padding_free: bool, sp: SequenceParallel) -> torch.Tensor:
    """The teacher's hidden states that predict the micro-batch's response tokens [N, H_t] (a frozen
    model is in eval mode: fsdp_utils.load_sharded_model). Its root FSDP unit stays gathered (its
    head is applied in the student's chunks); the column's release reshards it."""
    inputs, index, _ = forward_inputs(teacher, batch, padding_free, sp)
    return response_states(teacher, inputs, index, sp)


def divergence(chunk: HeadChunk, head: torch.nn.Module, hidden: torch.Tensor,
               kl: str) -> torch.Tensor:
    """The divergence between the policy's distribution p and the teacher's q (its `head` on its
    hidden states of the chunk's tokens [c, H_t]) at each token of the chunk [c], over the whole
    vocabulary (top-k / top-p left out: a truncated p is 0 where q is not, and the forward KL would
    be infinite), at the same temperature, the teacher's logits without gradient:
    `reverse` KL(p || q) = sum_v p_v (log p_v - log q_v),
    `forward` KL(q || p) = sum_v q_v (log q_v - log p_v).
    p = [0.5, 0.5], q = [0.8, 0.2]: reverse 0.223, forward 0.193. Heads of different sizes (one
    tokenizer, padded rows): p and q over the rows both have."""
    with torch.no_grad():  # as the student's below, so that an equal teacher gives exactly 0
        q_logits = chunk.logits_of(head, hidden)  # [c, V_t]
        # a teacher of the same tokenizer padded to another size (Qwen2.5-7B's 152,064 rows beside
        # 0.5B's 151,936): both over the rows they share, which hold the tokenizer's
        shared = min(chunk.logits.shape[-1], q_logits.shape[-1])
        q_logits = q_logits[:, :shared]  # [c, V]
        logq = q_logits - q_logits.logsumexp(-1, keepdim=True)
    logp, p = chunk.distribution(shared)  # [c, V] each, with their gradient
    if kl == "reverse":
        return (p * (logp - logq)).sum(-1)
    return (logq.exp() * (logq - logp)).sum(-1)
