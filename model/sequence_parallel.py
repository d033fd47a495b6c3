"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023):
one packed row over N ranks.

    # on every rank: groups of 2 consecutive ranks
    sp = SequenceParallel.build(size=2)
    # the same [b, R] on both ranks of a group
    logprobs = response_logprobs(model, micro_batch, temperature, sp=sp)

The ranks of a group hold the same micro-batch. Its packed row [1, S] is padded to a multiple of N
(the padding a sequence of its own, which no other attends to) and cut into N contiguous slices;
each rank embeds its slice and runs the MLPs, norms and the output head on it alone. Around
attention, an all-to-all trades the sequence slices of all heads for all tokens of 1/N of the heads
(each rank then attends exactly as a rank holding the whole row would, for its heads), and the
inverse all-to-all gives each rank its slice of every head back. Key/value heads fewer than N
(grouped-query attention) are repeated first so that every rank has the ones its query heads read.
Both all-to-alls have their backward (the inverse all-to-all), so gradients are exact: a rank's
weight gradient is its slice's share, and the ranks' shares sum to the whole row's (FSDP2 sums them
with the data-parallel ones).

Activations per rank are 1/N of the row's (attention's too: all S tokens, but h/N heads), the
weights are sharded by FSDP2 over all ranks as without sequence parallelism, and each attention
layer moves four tensors of [S/N, h, d] per rank through all-to-alls (query, key, value and the
output; as many again in the backward).

Vision-language models: the vision tower runs on every rank of the group on all the row's images,
and their embeddings are merged into the whole row before it is cut (the cut runs as the language
model's forward pre-hook, on its input embeddings, its 3-D M-RoPE positions and the inputs of the
family's own, which its adapter in vision.py cuts): an image's tokens may straddle two slices, and
the tower's cost is small beside the language model's at the lengths sequence parallelism is for.
The same hook hands the group to the language model's attention layers; the tower's never sees it.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import (all_gather_single_autograd,
                                                        all_to_all_single_autograd)
from transformers import AutoConfig

from model.families import has_linear_attention
from model.lora import base_of
from model.vision import family, is_vision_language


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group of `size` consecutive ranks (`rank`: its place in it;
    size 1: off) and its data-parallel group: the ranks at the same place in every group, which hold
    different data."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    data_parallel: dist.ProcessGroup | None = None  # None: every rank (size 1)

    @classmethod
    def build(cls, size: int, model_path: str = "") -> "SequenceParallel":
        """The groups of `size` consecutive ranks (ranks 0..size-1, size..2 size-1, ...: on one
        node, where the all-to-alls are fastest), a 2-D mesh of data x sequence; every rank creates
        every group, as torch.distributed asks. FSDP2 shards over all ranks as without sequence
        parallelism (the least memory). The model's attention heads must split evenly over a
        group, and the model must have no linear attention: Qwen3.5's and Qwen3-Next's layers carry
        a state along the whole row, which a rank holding a slice of it cannot start from."""
        if size == 1:
            return cls()
        if model_path:
            config = AutoConfig.from_pretrained(model_path)
            if has_linear_attention(config):
                raise SystemExit(f"--actor.sequence-parallel-size {size}: the model's linear-"
                                 "attention layers carry a state along the whole sequence, which "
                                 "cannot be cut over ranks; use 1 (long sequences: "
                                 "--actor.max-tokens-per-micro-batch, --actor.gradient-"
                                 "checkpointing)")
            heads = getattr(config, "text_config", config).num_attention_heads
            if heads % size:
                raise SystemExit(f"--actor.sequence-parallel-size {size}: the model's {heads} "
                                 "attention heads do not split evenly over the ranks of a group; "
                                 "choose a size that divides them")
        world, me = dist.get_world_size(), dist.get_rank()
        mesh = torch.arange(world).view(world // size, size)  # [data, sequence]
        groups = [dist.new_group(row.tolist()) for row in mesh]
        columns = [dist.new_group(column.tolist()) for column in mesh.T]
        return cls(size, me % size, groups[me // size], columns[me % size])

    def share(self, groups: list, scores) -> list:
        """The rollout groups of every rank of this rank's sequence-parallel group, in rank order:
        each rank generated its own prompts, and from here on all of them train on all of these
        (rewards.Group objects). Each rank's groups are scored first, where they were sampled
        (`scores`: their rewards.RoundScores: the reward function's, the reward model's on their own
        rows); size 1: the groups as they are, scored later."""
        if self.size == 1:
            return groups
        scores.give(groups)
        everyone = [None] * self.size
        dist.all_gather_object(everyone, groups, group=self.group)
        return [group for rank_groups in everyone for group in rank_groups]

    def padding(self, total: int) -> int:
        """Tokens to append to a packed row of `total` tokens so that it cuts into N equal
        slices."""
        return -total % self.size

    def bounds(self, total: int) -> tuple[int, int]:
        """This rank's slice [start, end) of a padded row of `total` tokens.
        N = 2, 6 tokens: rank 1 [3, 6)."""
        piece = total // self.size
        return self.rank * piece, (self.rank + 1) * piece

    @contextmanager
    def hooked(self, model):
        """While in it, the model's language model takes this rank's slice of its inputs (a forward
        pre-hook)."""
        if self.size == 1:
            yield
            return
        decoder, adapter = base_of(model).model, None
        # the family's text decoder and own inputs (vision.py)
        if is_vision_language(model.config):
            adapter = family(model.config)
            decoder = adapter.language_model(base_of(model))
        hook = decoder.register_forward_pre_hook(partial(self._slice, adapter), with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()

    def _slice(self, adapter, module, args, kwargs):
        """The language model's inputs cut to this rank's slice: token ids or embeddings
        [1, S, ...], positions [..., 1, S], a vision-language family's own inputs (`adapter`'s
        cut_inputs, vision.py; None: a text model); and the group, which its attention layers find
        in their kwargs (plumbing/attention.py). Given here, not with the model's inputs:
        transformers passes those on to the vision tower's attention too, whose rows are not cut
        (under flash-attn's varlen kernel every rank but the first would get uninitialised image
        embeddings)."""
        kwargs["sequence_parallel"] = self
        tokens = (kwargs["input_ids"] if kwargs.get("input_ids") is not None
                  else kwargs["inputs_embeds"])
        piece = tokens.shape[1] // self.size
        cut = slice(self.rank * piece, (self.rank + 1) * piece)
        for name in ("input_ids", "inputs_embeds"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name][:, cut]
        kwargs["position_ids"] = kwargs["position_ids"][..., cut]
        if adapter is not None:
            kwargs.update(adapter.cut_inputs(kwargs, cut))
        return args, kwargs

    def attend(self, attention, module, query, key, value, attention_mask, **kwargs):
        """`attention` (transformers' interface: query/key/value [1, heads, S/N, d] -> [1, S/N,
        heads, d]) on all tokens of this rank's 1/N of the heads, between the two all-to-alls."""
        # fewer key/value heads than ranks: each query head's own, repeated
        if key.shape[1] % self.size:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        query, key, value = (self._sequence_to_heads(t) for t in (query, key, value))
        output, weights = attention(module, query, key, value, attention_mask, **kwargs)
        return self._heads_to_sequence(output), weights

    def _sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[1, h, S/N, d] (all heads, this rank's slice) -> [1, h/N, S, d] (this rank's heads, all
        slices in order)."""
        _, h, s, d = x.shape
        # block j: the heads rank j attends with
        send = x.reshape(self.size, h // self.size, s, d).contiguous()
        # block j: slice j of my heads
        received = all_to_all_single_autograd(send, None, None, self.group)
        return received.transpose(0, 1).reshape(1, h // self.size, self.size * s, d)

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[1, S, h/N, d] (attention's output, this rank's heads) -> [1, S/N, h, d] (this rank's
        slice, all heads)."""
        _, S, h, d = x.shape
        # block j: slice j, for rank j
        send = x.reshape(self.size, S // self.size, h, d).contiguous()
        # block j: rank j's heads
        received = all_to_all_single_autograd(send, None, None, self.group)
        return received.permute(1, 0, 2, 3).reshape(1, S // self.size, self.size * h, d)

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """The group's sum of `values` (each rank's own entries, zeros elsewhere), with its
        backward: every rank gets the whole, and the gradient of each entry flows back to the rank
        that computed it."""
        if self.size == 1:
            return values
        return all_gather_single_autograd(values, 0, self.group).view(self.size, -1).sum(0)


NO_SP = SequenceParallel()  # sequence parallelism off
