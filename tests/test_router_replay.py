"""Router replay (model/router_replay.py): the trainer's mixture layers take the engine's experts, with gate weights
from their own router's softmax.

- The hook on a hand-made router: the replayed experts are used, the gate weights are the router's softmax at them,
  renormalised, with a gradient to the router's weight; a token the engine never routed keeps its own; the agreement
  counts.
- On tiny Qwen3-MoE and Qwen3-Next: packed and padded forwards give the same log-probs with a replayed routing, and
  replaying the model's own routing changes nothing (another one does); activation checkpointing's recomputation
  replays too; the hf engine's recording of a left-padded generate is each sequence's own routing, and its generate
  (through LoRA's wrapper) never replays a trainer forward's routing.
- The record's travel (Batch rows and padding) and the engines' outputs: vLLM's own on GPUs (a stand-in of the
  documented shape), the CPU capture's request ids.
2 steps under torchrun with replay, and the engine gap with and without it: test_train.py.
"""

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

import grpo
from conftest import ENGINE_GAP, ENGINE_GAP_BF16, FAST, SIGNAL
from launches import launched_run, uses_runs
from logprobs import Batch, make_batch, response_logprobs, sequence_starts
from model.families import linear_attention_per_sequence
from model.lora import LoRAConfig, add_adapters
from model.router_replay import (ROUTING_KWARG, Recording, RouterReplay, completion_of, engine_rows, mixture_shape,
                                 routers)
from plumbing.attention import PACKED_SDPA
from plumbing.tiny import build_tiny_model
from rollout import RolloutConfig, VLLMRollout
from test_logprobs import PROMPTS, RESPONSES, assert_same_gradients, gradients

MIXTURES = ["qwen3_moe", "qwen3_next", "qwen3_5_moe_text"]


class OneRouter(torch.nn.Module):
    """A model of one mixture layer's router (4 experts, 2 a token, hidden 2) whose forward returns the router's
    outputs, through a decoder (`model`) as transformers' models do."""

    def __init__(self):
        super().__init__()
        config = SimpleNamespace(num_experts_per_tok=2, num_experts=4, norm_topk_prob=True, hidden_size=2)
        self.model = Decoder()
        self.model.layers[0].gate = Qwen3MoeTopKRouter(config)
        with torch.no_grad():  # logits = hidden @ W.T: [h0, h1, -h0, -h1]
            self.model.layers[0].gate.weight.copy_(torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]]))

    def forward(self, hidden, **kwargs):
        return self.model(hidden, **kwargs)


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])

    def forward(self, hidden):
        return self.layers[0].gate(hidden)


def test_replay_takes_the_engines_experts_with_the_routers_own_gate_weights():
    """Token [2, 0.5] (logits [2, 0.5, -2, -0.5]): its own top-2 are experts 0 and 1; replayed 2 and 3, its gate
    weights are softmax at them renormalised, e^-2 / (e^-2 + e^-0.5) = 0.1824 and 0.8176, with a gradient to the
    router's weight. The second token is replayed its own experts (in the other order), the third was never routed
    (0s): both keep the router's own; the agreement counts the second of the two routed."""
    model = OneRouter()
    replay = RouterReplay(model)
    hidden = torch.tensor([[2.0, 0.5], [2.0, 0.5], [0.5, 2.0]])
    routing = torch.tensor([[[3, 4]], [[2, 1]], [[0, 0]]], dtype=torch.uint8)  # [tokens, layers, k]: expert + 1
    _, weights, experts = model(hidden, **{ROUTING_KWARG: routing})
    assert experts.tolist() == [[2, 3], [1, 0], [1, 0]]
    low = math.exp(-2) / (math.exp(-2) + math.exp(-0.5))
    torch.testing.assert_close(weights[0], torch.tensor([low, 1 - low]), atol=1e-6, rtol=0)
    _, own_weights, own = model(hidden)  # no routing: the router's own, untouched
    assert own.tolist() == [[0, 1], [0, 1], [1, 0]]
    torch.testing.assert_close(weights[1], own_weights[1].flip(-1))
    torch.testing.assert_close(weights[2], own_weights[2])
    weights[0, 0].backward()
    assert model.model.layers[0].gate.weight.grad.abs().sum() > 0
    assert (replay.agreed.item(), replay.routed.item()) == (1, 2)


def test_the_record_travels_with_its_rows_and_pads_with_unrouted():
    """Batch rows of different lengths: the [B, T, layers, k] record is padded with 0 (never routed), keeps its dtype,
    and a row cut and rebuilt (the exchange between ranks) is the row it was."""
    records = [torch.randint(1, 5, (len(p) + len(r), 2, 2), dtype=torch.uint8) for p, r in zip(PROMPTS, RESPONSES)]
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0, routed_experts=records)
    assert batch.routed_experts.shape == (5, 10, 2, 2) and batch.routed_experts.dtype == torch.uint8
    assert (batch.routed_experts[2, len(records[2]):] == 0).all()
    again = Batch.from_rows([batch.row(4), batch.row(2)], pad_id=0)
    assert torch.equal(again.routed_experts[0], records[4]) and torch.equal(again.routed_experts[1, :4], records[2])


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("mixtures")
    return {name: build_tiny_model(name, folder / name) for name in MIXTURES}


def trainer_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA)
    linear_attention_per_sequence(model)
    return model


@pytest.mark.parametrize("architecture", MIXTURES)
def test_replayed_routing_packed_and_padded_and_its_own_routing_changes_nothing(paths, architecture):
    """Another routing than the model's own (random experts): packed and padded forwards agree (~1e-6), and the
    log-probs move (it is used). The model's own routing replayed (recorded in one forward): the log-probs without
    replay, and an agreement of 1."""
    model = trainer_model(paths[architecture])
    layers, experts, k = mixture_shape(model.config)
    generator = torch.Generator().manual_seed(0)
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    other = [(torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(n * layers)]) + 1)
             .view(n, layers, k).to(torch.uint8) for n in lengths]
    with torch.no_grad():
        with Recording(model, layers) as recording:  # the packed row: each sequence's own routing
            plain = response_logprobs(model, make_batch(PROMPTS, RESPONSES, pad_id=0), 1.0)
        # every token's, the last one's too
        own = [recording.record(1, 0, start, n + 1, experts)[:-1] for start, n in zip(sequence_starts(lengths, True),
                                                                                     lengths)]
        replay = RouterReplay(model)
        batch = make_batch(PROMPTS, RESPONSES, pad_id=0, routed_experts=other)
        packed, padded = response_logprobs(model, batch, 1.0, True), response_logprobs(model, batch, 1.0, False)
        replay.agreed = replay.routed = 0
        same = response_logprobs(model, make_batch(PROMPTS, RESPONSES, pad_id=0, routed_experts=own), 1.0)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert (packed - plain).abs().max() > 1e-3
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    assert replay.agreed == replay.routed == sum(lengths) * layers


def test_the_hf_engines_recording_of_a_left_padded_generate_is_each_sequences_own(paths):
    """generate on left-padded prompts of lengths 2 and 5 (a prefill, then a token a step): each row's record, cut
    after its padding, is the routing of its sequence's own forward, the last token unrouted."""
    model = trainer_model(paths["qwen3_moe"])
    layers, experts, _ = mixture_shape(model.config)
    prompts = [[1, 30], [1, 25, 26, 27, 28]]
    input_ids = torch.tensor([[0, 0, 0, *prompts[0]], prompts[1]])
    with torch.no_grad(), Recording(model, layers) as recording:
        sequences = model.generate(input_ids, attention_mask=(torch.arange(5) >= torch.tensor([[3], [0]])).long(),
                                   max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        tokens = [*prompt, *sequences[row, 5:].tolist()]
        record = recording.record(2, row, 5 - len(prompt), len(tokens), experts)
        with torch.no_grad(), Recording(model, layers) as alone:
            model(torch.tensor([tokens]))
        assert torch.equal(record, alone.record(1, 0, 0, len(tokens), experts))


def test_engine_rows_and_the_vllm_outputs_of_a_sample():
    """vLLM on GPUs: a completion's `routed_experts` (numpy, [prompt + response - 1, layers, k], as its outputs.py
    documents and its aux-output connector cuts it) becomes the record, expert + 1, the last token's row 0; on a CPU
    the capture's rows of the sample's engine request (its id: f"{index}_{external}-{random}" with n > 1)."""
    assert engine_rows(np.array([[[2, 0]]], dtype=np.uint8), 2, 4).tolist() == [[[3, 1]], [[0, 0]]]
    assert engine_rows(np.array([[[300, 511]]], dtype=np.uint16), 1, 512).dtype == torch.int16
    assert completion_of("3_12-ab12cd34") == ("12", 3) and completion_of("7-ab12cd34") == ("7", 0)
    engine = object.__new__(VLLMRollout)
    engine.cfg, engine.mixture = RolloutConfig(routed_experts=True), (2, 4, 2)
    out = SimpleNamespace(request_id="0", prompt_token_ids=[1, 2, 3])
    experts = np.random.default_rng(0).integers(0, 4, (4, 2, 2)).astype(np.uint8)
    sample = SimpleNamespace(index=1, token_ids=[5, 6], routed_experts=experts)
    for engine.on_gpu, captured in [(True, {}), (False, {("0", 1): torch.from_numpy(experts.astype(np.int16))})]:
        record = engine._routing(out, sample, captured)
        assert record.shape == (5, 2, 2) and record.dtype == torch.uint8
        assert torch.equal(record[:4], torch.from_numpy(experts + 1)) and (record[4] == 0).all()


def test_routers_are_found_by_their_decoder_layer(paths):
    """Every decoder layer of the tiny mixtures has a router, by its index (the record's layer axis)."""
    for architecture in MIXTURES:
        config = AutoConfig.from_pretrained(paths[architecture])
        model = AutoModelForCausalLM.from_config(config)
        assert sorted(routers(model)) == list(range(config.num_hidden_layers))


def test_refused_in_one_line():
    """Sequence parallelism (and the other combinations check_replay_flags lists) are refused before anything loads,
    in one line naming both flags; a model without a mixture when the actor is loaded."""
    cfg = grpo.parse_config(["--actor.router-replay", "--actor.sequence-parallel-size", "2"])
    with pytest.raises(SystemExit, match=r"^--actor.router-replay with --actor.sequence-parallel-size 2 [^\n]*$"):
        grpo.check_config(cfg, 2)
    assert cfg.rollout.routed_experts  # the engines return the routing
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=64,
                                                                  num_hidden_layers=1, num_attention_heads=1,
                                                                  num_key_value_heads=1, vocab_size=64))
    with pytest.raises(SystemExit, match="^--actor.router-replay: tiny:qwen2 has no mixture of experts"):
        RouterReplay.start(cfg, dense, None)


def near_ties(folder: Path) -> list:
    """A tiny Qwen3-MoE whose router rows are near-duplicates (each expert's row 1% of its spread from the first's):
    its experts nearly tie for every token, and a bf16 engine beside the fp32 trainer picks others for many. Three
    parts: without replay, with it (the vLLM engine, bf16 on the CPU's capture), and with the hf engine."""
    path = build_tiny_model("qwen3_moe", folder / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                weight.copy_(weight[:1] + 0.01 * (weight - weight[:1]))
    model.save_pretrained(path)
    run = ["--actor.model-path", path, "--trainer.total-steps", "2", "--trainer.output-dir", folder,
           "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
           "--trainer.no-save-final", *FAST, *SIGNAL]
    bf16 = ["--rollout.dtype", "bfloat16"]
    return [[*run, *bf16, "--trainer.experiment-name", "plain"],
            [*run, *bf16, "--trainer.experiment-name", "replay", "--actor.router-replay"],
            [*run, "--rollout.engine", "hf", "--trainer.experiment-name", "hf", "--actor.router-replay"]]


launched_run(name="router_replay_near_ties")(near_ties)


@uses_runs("router_replay_near_ties")
@pytest.mark.slow
def test_replay_closes_the_engine_gap_of_flipped_experts(runs):
    """The same first step's samples (same seeds, same weights) with and without replay: without, the trainer routes
    near-tied tokens elsewhere than the bf16 engine did (agreement ~0.81 measured) and its log-probs of the sampled
    tokens are up to ~0.05 apart (mean ~8e-3); with replay the gap is bf16's rounding (max ~4e-3, mean ~1.5e-3). The
    hf engine generates with the trainer's own model: its recorded routing is the trainer's own (agreement 1)."""
    plain, replay, hf = (runs["router_replay_near_ties"].metrics(name) for name in ("plain", "replay", "hf"))
    assert len(plain) == len(replay) == len(hf) == 2 and "actor/router_agreement" not in plain[0]
    assert plain[0]["train/reward_overall"] == replay[0]["train/reward_overall"]  # the same samples
    assert replay[0]["actor/router_agreement"] < 0.95
    assert replay[0]["rollout/logprob_diff_max"] < plain[0]["rollout/logprob_diff_max"] / 4
    assert replay[0]["rollout/logprob_diff_mean"] < plain[0]["rollout/logprob_diff_mean"] / 2
    assert all(m["rollout/logprob_diff_max"] < ENGINE_GAP_BF16 for m in replay)
    assert all(m["actor/router_agreement"] == 1 and m["rollout/logprob_diff_max"] < ENGINE_GAP for m in hf)


def test_a_generate_after_a_replayed_forward_routes_itself_under_peft(paths):
    """The hf engine generates with the trainer's model, LoRA's peft wrapper around it, whose generate bypasses the
    wrapper's forward: the routing of the last replayed forward (17 tokens) is not replayed onto generate's steps
    (it would fail on their token counts), as the decoder's own hook clears it."""
    model = add_adapters(trainer_model(paths["qwen3_moe"]), LoRAConfig(rank=2))
    layers, experts, k = mixture_shape(model.config)
    RouterReplay(model)
    records = [torch.ones(len(p) + len(r), layers, k, dtype=torch.uint8) for p, r in zip(PROMPTS[:2], RESPONSES[:2])]
    with torch.no_grad():
        response_logprobs(model, make_batch(PROMPTS[:2], RESPONSES[:2], pad_id=0, routed_experts=records), 1.0)
        assert model.generate(input_ids=torch.tensor([[1, 30]]), max_new_tokens=2, do_sample=False).shape == (1, 4)


def test_activation_checkpointing_recomputes_through_the_replayed_experts(paths):
    """The backward's recomputation of each layer (--actor.gradient-checkpointing) replays the same experts: the
    gradients of a replayed forward, the router's included, are those without checkpointing."""
    model = trainer_model(paths["qwen3_moe"]).train()
    layers, experts, k = mixture_shape(model.config)
    RouterReplay(model)
    generator = torch.Generator().manual_seed(1)
    records = [torch.randint(1, experts + 1, (len(p) + len(r), layers, k), generator=generator, dtype=torch.uint8)
               for p, r in zip(PROMPTS[:3], RESPONSES[:3])]
    batch = make_batch(PROMPTS[:3], RESPONSES[:3], pad_id=0, routed_experts=records)
    weights = torch.randn(batch.responses.shape, generator=generator)
    plain = gradients(model, lambda: response_logprobs(model, batch, 1.0), weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing and model.training
    assert_same_gradients(plain, gradients(model, lambda: response_logprobs(model, batch, 1.0), weights))
    assert plain["model.layers.0.mlp.gate.weight"].abs().max() > 0
