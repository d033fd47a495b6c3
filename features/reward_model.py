"""A reward model (--reward.model): a frozen sequence-classification checkpoint of one label (a
Bradley-Terry reward model) whose score of each whole sequence is the key `model` beside the reward
function's, combined by --reward.weights (rewards.Scoring).

    torchrun --nproc_per_node 2 grpo.py --reward.model tiny:qwen2_rm    # a random one, for tests
    ... --reward.model PATH --reward.weights overall 1 model 0.5

Wired into grpo.py by one call, RewardModel.start (None without one), whose result is what
rewards.Scoring is given as its `model`: groups (and their trainer batch) -> a score a response.

Design decisions:
- It scores the trainer's own token ids, so its tokenizer must be the policy's (refused at start-up
  otherwise); it is sharded as the reference is (fsdp_utils.load_scorer) and moved with the training
  state, and its pass runs over the trainer's batch in the actor's packed micro-batches.
- A score is the score head on the decoder's hidden state at the sequence's last token, as the model
  pools it itself, in fp32.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from fsdp_utils import load_scorer
from logprobs import (Batch, batch_of, decoder_states, forward_inputs, over_micro_batches,
                      sequence_starts)
from plumbing.collectives import to_device
from plumbing.tiny import model_class


@dataclass
class RewardModel:
    """A run's reward model (frozen, sharded as the reference is) and how its pass runs: the
    processor and pad id that make the trainer's batch, the actor's micro-batches (`actor_cfg`:
    grpo.ActorConfig)."""

    model: torch.nn.Module
    processor: Any
    pad_id: int
    device: torch.device
    actor_cfg: Any

    @classmethod
    def start(cls, cfg, run, tokenizer, processor) -> "RewardModel | None":
        """The reward model of --reward.model (grpo.Config `cfg`, grpo.Run `run`: its path resolved,
        the device), refused unless it is one and its tokenizer is the policy's
        (load_reward_model); None without one. An evaluation scores with it too."""
        if not run.reward_model_path:
            return None
        model = load_reward_model(run.reward_model_path, run.device, tokenizer,
                                  cfg.actor.fsdp_cpu_offload)
        return cls(model, processor, tokenizer.pad_token_id, run.device, cfg.actor)

    def __call__(self, groups: list, batch: Batch | None = None) -> list[float]:
        """Its score of every response of `groups` (rewards.Group), in the trainer's batch
        (`batch`, built here when not given) and the actor's micro-batches: rewards.Scoring's
        `model`."""
        batch = batch or batch_of(groups, self.processor, self.pad_id, self.device)
        return batched_scores(self.model, batch, self.actor_cfg.micro_batch_size,
                              self.actor_cfg.max_tokens_per_micro_batch,
                              self.actor_cfg.padding_free).tolist()


def load_reward_model(path: str, device: torch.device, tokenizer,
                      cpu_offload: bool = False) -> torch.nn.Module:
    """A frozen sequence-classification reward model that scores the trainer's own token ids
    (fsdp_utils.load_scorer)."""
    config = AutoConfig.from_pretrained(path)
    if (model_class(config).__name__ != "AutoModelForSequenceClassification"
            or config.num_labels != 1):
        raise SystemExit(f"--reward.model {path}: not a reward model (a "
                         "...ForSequenceClassification checkpoint of one label), but "
                         f"{', '.join(config.architectures or [type(config).__name__])}")
    return load_scorer(path, device, tokenizer, cpu_offload,
                       f"--reward.model {path}: its tokenizer is not the policy's, and the reward "
                       "model scores the policy's token ids; pick a reward model trained on the "
                       "policy's tokenizer")


def sequence_scores(model, batch: Batch, padding_free: bool = True) -> torch.Tensor:
    """A reward model's score of each whole sequence of a micro-batch [b]: its score head (a
    sequence-classification model's `score`) on the decoder's hidden state at the sequence's last
    token, as the model pools it itself."""
    inputs, _, _ = forward_inputs(model, batch, padding_free)
    states = decoder_states(model, inputs)  # the model's own pooling of a packed row is not used
    lengths = batch.sequence_lengths
    ends = to_device({"ends": [start + n - 1 for start, n
                               in zip(sequence_starts(lengths, padding_free), lengths)]},
                     batch.input_ids.device)["ends"]
    # in fp32 (FSDP2 computes in bf16 on GPU): a score is one number, kept to its last bits
    head = model.score
    bias = None if head.bias is None else head.bias.float()
    return F.linear(states.flatten(0, 1)[ends].float(), head.weight.float(), bias)[:, 0]  # [b]


@torch.no_grad()
def batched_scores(model, batch: Batch, micro_batch_size: int, max_tokens: int = 0,
                   padding_free: bool = True) -> torch.Tensor:
    """sequence_scores over micro-batches (logprobs.over_micro_batches: eval mode, the root
    resharded after) -> [B]."""
    out = torch.zeros(len(batch), device=batch.input_ids.device)  # [B]
    return over_micro_batches(model, batch, micro_batch_size, max_tokens, out,
                              lambda micro: sequence_scores(model, micro, padding_free))
