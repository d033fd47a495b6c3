"""Device placement without a GPU: the training step's tensor code on the `meta` device, collectives as NCCL sees them.

On a CPU every tensor shares one device, so a CPU tensor meeting GPU tensors (the crash a GPU run would hit in its
first step) cannot fail here. On `meta` it does: any CPU tensor in a non-scalar op with a meta tensor raises. So
the step's functions run here with a stand-in model and the batch on `meta`, in a world of one whose backend
reports "nccl" and whose collectives check that every tensor they get is on the data's device (NCCL only moves
GPU tensors). On a GPU machine the same tests also run on `cuda` under a real NCCL group
(benchmarks/gpu_check.py runs them there).
"""

import ast
from dataclasses import fields, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import grpo
import plumbing.metrics as metrics
from conftest import free_port
from algorithms import (ADVANTAGE_ESTIMATORS, AdvantageInputs, AlgorithmConfig, LossInputs, POLICY_LOSSES, aggregate,
                        kl_penalty, token_rewards)
from grpo import Config, Group, backward_mini_batch
from logprobs import batched_logprobs, make_batch, response_logprobs
from plumbing.collectives import all_reduce, sum_over_ranks, to_floats
from plumbing.metrics import logprob_metrics, score_metrics
from model.vision import vision_inputs

DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_object")
SEEN: list[str] = []  # the collectives the checking stand-ins received (meta)


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """A world of one on `device`: real NCCL on a GPU; on `meta`, gloo dressed as NCCL with checking collectives."""
    device = torch.device(request.param)
    init = f"tcp://127.0.0.1:{free_port()}"
    if device.type == "cuda":
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        SEEN.clear()

        def checked(name):
            def collective(tensor, *args, **kwargs):
                tensors = tensor if isinstance(tensor, list) else [tensor]
                for t in tensors:
                    assert t.device == device, f"dist.{name} got a tensor on {t.device}: NCCL needs it on {device}"
                SEEN.append(name)  # a world of one: the reduction is the identity, nothing to send
            return collective

        for name in COLLECTIVES[:-1]:
            monkeypatch.setattr(dist, name, checked(name))
    yield device
    dist.destroy_process_group()


class Decoder(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed, self.position = torch.nn.Embedding(vocab, hidden), torch.nn.Embedding(32, hidden)

    def forward(self, input_ids, position_ids):
        return SimpleNamespace(last_hidden_state=torch.tanh(self.embed(input_ids) + self.position(position_ids)))

    def get_rope_index(self, input_ids, mm_token_type_ids, attention_mask=None, **grids):
        """Text-only rows: the 3-D positions of M-RoPE are the 1-D ones, three times."""
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand(3, *input_ids.shape), None


class StandIn(torch.nn.Module):
    """A tiny causal LM with transformers' calling convention and layout (a decoder `model`, an output head; a real
    one cannot run on meta end to end), and a vision-language model's config (of Qwen2-VL's family: vision.py's
    adapter reads it), so the placeholder-token bias runs too (its 2-D position ids are those of a text-only
    micro-batch, which is all this batch holds)."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        self.config = SimpleNamespace(model_type="qwen2_vl", vision_config={}, image_token_id=14,
                                      video_token_id=15)
        self.model, self.head = Decoder(vocab, hidden), torch.nn.Linear(hidden, vocab)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, position_ids, logits_to_keep, use_cache=False, **packing):
        """`packing`: what a packed row tells the attention (cu_seq_lens_q, ...), which the stand-in has none of;
        its tensors must be on the data's device too."""
        assert_on(input_ids.device, *(v for v in packing.values() if isinstance(v, torch.Tensor)))
        # [4, 1, S]: text row
        hidden = self.model(input_ids, position_ids[0] if position_ids.dim() == 3 else position_ids)
        return SimpleNamespace(logits=self.head(hidden.last_hidden_state[:, logits_to_keep]))


def rollout_batch(device):
    """Two groups of n = 2 responses, with their engine log-probs, on `device`."""
    prompts = [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    responses = [[9, 2], [10, 11, 2], [12], [13, 2]]
    engine_logprobs = [[-1.0, -0.5], [-2.0, -0.1, -0.3], [-0.7], [-1.5, -0.2]]
    return make_batch(prompts, responses, pad_id=0, rollout_logprobs=engine_logprobs, device=device)


def assert_on(device, *tensors):
    for t in tensors:
        assert t.device.type == device.type, f"a result is on {t.device}, not {device}"


@pytest.mark.parametrize("padding_free", [True, False])
def test_batch_and_logprobs_stay_on_the_device(device, padding_free):
    """Packed or padded: every index (built on the host from the lengths) meets the data on its device."""
    batch = rollout_batch(device)
    assert_on(device, *(v for f in fields(batch) if isinstance(v := getattr(batch, f.name), torch.Tensor)))
    with torch.device(device):
        model = StandIn()
    logprobs = response_logprobs(model, batch, 0.7, padding_free)  # the GPU crash of issue 6 lived here
    assert logprobs.shape == batch.response_mask.shape
    assert_on(device, logprobs, batched_logprobs(model, batch, 0.7, micro_batch_size=3, padding_free=padding_free))


def test_image_and_video_inputs_follow_the_batch_to_its_device(device):
    """The image and video tensors come from the processor on the host; the forward gets them on the batch's device,
    each row's in row order, and the token types (1 image, 2 video) are computed there."""
    input_ids = torch.tensor([[1, 14, 14, 5], [1, 5, 6, 0], [1, 15, 15, 14]], device=device)
    rows = [{"pixel_values": torch.zeros(8, 6), "image_grid_thw": torch.tensor([[1, 2, 4]])}, None,
            {"pixel_values_videos": torch.ones(16, 6), "video_grid_thw": torch.tensor([[2, 2, 4]]),
             "second_per_grid_ts": torch.tensor([1.0]), "pixel_values": torch.ones(4, 6),
             "image_grid_thw": torch.tensor([[1, 2, 2]])}]
    inputs = vision_inputs(StandIn(), input_ids, rows)
    assert inputs["pixel_values"].shape == (12, 6) and inputs["pixel_values_videos"].shape == (16, 6)
    assert inputs["image_grid_thw"].shape == (2, 3) and inputs["second_per_grid_ts"].shape == (1,)
    assert inputs["mm_token_type_ids"].shape == (3, 4)
    if device.type != "meta":  # a meta tensor has no values
        assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [0, 2, 2, 1]]
    assert_on(device, *inputs.values())
    assert vision_inputs(StandIn(), input_ids, [None, None, None]) == {}


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_token_rewards_and_every_estimator_stay_on_the_device(device, estimator):
    mask = rollout_batch(device).response_mask
    old, ref = torch.randn(mask.shape, device=device), torch.randn(mask.shape, device=device)
    kl_in_reward = AlgorithmConfig(use_kl_loss=False, use_kl_in_reward=True)  # adaptive needs the host: GPU only
    rewards, _ = token_rewards(torch.tensor([1.0, 0.0, 0.5, 0.5], device=device), mask, old, ref, kl_in_reward, 0.1)
    baselines = torch.tensor([0.5, 0.0], device=device)  # [G]
    teacher_gap = torch.randn(mask.shape, device=device)  # on-policy distillation's (the others ignore it)
    advantages = ADVANTAGE_ESTIMATORS[estimator](AdvantageInputs(rewards, mask, 2, baselines, sum_over_ranks,
                                                                 teacher_gap, reward_weight=0.5), AlgorithmConfig())
    assert advantages.shape == mask.shape
    assert_on(device, rewards, advantages)


@pytest.mark.parametrize("loss_type", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_loss_kl_and_aggregation_stay_on_the_device(device, loss_type, mode):
    mask = rollout_batch(device).response_mask
    logprobs, old, ref, advantages = (torch.randn(mask.shape, device=device) for _ in range(4))
    inputs = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask)
    loss, stats = POLICY_LOSSES[loss_type](inputs, AlgorithmConfig())
    counts = all_reduce({"tokens": mask.sum(), "sequences": mask.shape[0]}, device)
    kls = [kl_penalty(logprobs, ref, kind) for kind in ("kl", "abs", "mse", "low_var_kl")]
    aggregated = aggregate(loss, mask, mode, global_tokens=counts["tokens"], global_sequences=counts["sequences"],
                           token_sum_norm=4.0)
    assert_on(device, loss, *stats.values(), *kls, aggregated)


def test_update_and_metrics_stay_on_the_device(device):
    batch = rollout_batch(device)
    with torch.device(device):
        model = StandIn()
    old = batched_logprobs(model, batch, 1.0, micro_batch_size=4)
    cfg = Config()
    cfg.actor.micro_batch_size = 2
    batch = replace(batch, ref_logprobs=old + 0.1, advantages=torch.ones_like(old))
    sums, own = backward_mini_batch(model, replace(batch, old_logprobs=old), cfg)  # loss + KL loss + backward
    assert_on(device, *sums.values(), own, *(p.grad for p in model.parameters()))
    on_policy, own = backward_mini_batch(model, batch, cfg)  # the update's own old
    assert_on(device, *on_policy.values(), own)
    metrics = logprob_metrics(replace(batch, old_logprobs=old, ref_logprobs=old - 0.1))
    responses = [SimpleNamespace(token_ids=[9, 2], truncated=False), SimpleNamespace(token_ids=[3] * 4, truncated=True)]
    groups = [Group({}, responses, [{"overall": 1.0, "accuracy": 1.0}, {"overall": 0.0, "accuracy": 0.0}])]
    metrics.update(score_metrics("train", groups, device))
    assert_on(device, *metrics.values())
    if device.type != "meta":  # meta holds no numbers; elsewhere they reach the host in one copy
        floats = to_floats(metrics)
        assert floats["train/response_length_mean"] == 3.0 and floats["train/clip_ratio"] == 0.5
    else:
        assert len(SEEN) >= 5, "the collectives of the step were not seen"


@pytest.mark.parametrize("module", [grpo, metrics])
def test_the_trainer_issues_collectives_only_through_the_checked_helpers(module):
    """The step's collectives go through plumbing/collectives.py's helpers (exercised above), so none can bypass the
    device rule."""
    tree = ast.parse(Path(module.__file__).read_text())
    direct = [f"line {node.lineno}: dist.{node.attr}" for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dist"
              and node.attr in COLLECTIVES]
    assert not direct, (f"{module.__file__} calls collectives directly "
                        f"(use plumbing.collectives.all_reduce / sum_over_ranks): {direct}")
