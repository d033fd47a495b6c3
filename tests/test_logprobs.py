"""logprobs.py: the batch layout, padding-free packing, the chunked output head, token-budget micro-batches,
and the update's own old log-probs; each against a computation that does not use the feature.

Tolerances: fp32 on CPU; a packed forward and a padded one add the same numbers in another order, so values
agree to ~5e-7 and gradients to ~3e-6 (measured); the tests allow 1e-5 (values) and 1e-5 relative to the
largest gradient entry.
"""

import math
from dataclasses import replace

import pytest
import torch
from PIL import Image

from conftest import stripes
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import logprobs
from fsdp_utils import load_sharded_model
from grpo import Config, backward_mini_batch, update_policy
from logprobs import (balanced_bins, batched_logprobs, budget_bins, forward_inputs, make_batch, micro_batches,
                      response_logprobs)
from model.families import linear_attention_per_sequence
from plumbing.attention import PACKED_SDPA
from plumbing.metrics import logprob_metrics
from plumbing.tiny import build_tiny_model, build_tiny_vlm
from model.vision import Video, expand_prompt, family

PROMPTS = [[1, 20, 21, 22, 2], [1, 30], [1, 40, 41], [1, 25, 26, 27, 28, 29, 30], [1, 33]]
RESPONSES = [[50, 51, 2], [60, 61, 62, 63, 2], [70], [80, 81], [90, 91, 92, 93, 94, 95, 96, 2]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model with the trainer's attention (plumbing/attention.py's packed_sdpa on CPU)."""
    return AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path_factory.mktemp("m") / "m"),
                                                attn_implementation=PACKED_SDPA)


def full_logits_logprobs(model, prompts, responses, temperature):
    """The computation the trainer did before logprobs.py: each sequence's full [T, V] logits, fp32
    log-softmax, the response tokens gathered."""
    out = torch.zeros(len(prompts), max(map(len, responses)))
    for b, (p, r) in enumerate(zip(prompts, responses)):
        logits = model(torch.tensor([p + r])).logits[0].float() / temperature  # [T, V]
        out[b, : len(r)] = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1, len(p) + len(r) - 1), torch.tensor(r)]
    return out


def gradients(model, logprobs_fn, weights):
    model.zero_grad(set_to_none=True)
    (logprobs_fn() * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same_gradients(a: dict, b: dict):
    scale = max(g.abs().max().item() for g in a.values())
    assert scale > 1e-3, "the test must produce a real gradient"
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5 * scale


def test_make_batch_layout():
    batch = make_batch([[5, 6, 7], [8]], [[9, 2], [10, 11, 2]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 2], [8, 10, 11, 2, 0]]
    assert batch.responses.tolist() == [[9, 2, 0], [10, 11, 2]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.prompt_lengths == [3, 1] and batch.response_lengths == [2, 3]
    assert batch.select([1]).prompt_lengths == [1] and batch.select([1]).input_ids.tolist() == [[8, 10, 11, 2, 0]]


def test_packed_layout_by_hand(model):
    """The docstring's example: two sequences back to back, positions restarting, the predicting positions."""
    batch = make_batch([[5, 6], [7]], [[8, 9], [10]], pad_id=0)
    inputs, index, _ = forward_inputs(model, batch, padding_free=True)
    assert inputs["input_ids"].tolist() == [[5, 6, 8, 9, 7, 10]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]
    assert index.tolist() == [1, 2, 4]
    inputs, index, _ = forward_inputs(model, batch, padding_free=False)  # padded: rows of the longest, 4 tokens
    assert inputs["input_ids"].tolist() == [[5, 6, 8, 9], [7, 10, 0, 0]] and index.tolist() == [1, 2, 4]


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("padding_free", [True, False])
def test_chunked_head_gives_the_full_logits_values_and_gradients(model, monkeypatch, chunk, padding_free):
    """Hidden states of the response positions through the head a chunk at a time (chunks of 1 and 3 tokens split
    the 19 response tokens unevenly) give the full-logits computation's log-probs and gradients."""
    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", chunk)
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    expected = full_logits_logprobs(model, PROMPTS, RESPONSES, 0.7)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, batch, 0.7, padding_free), expected, atol=1e-5, rtol=0)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(0))
    assert_same_gradients(gradients(model, lambda: full_logits_logprobs(model, PROMPTS, RESPONSES, 0.7), weights),
                          gradients(model, lambda: response_logprobs(model, batch, 0.7, padding_free), weights))


def test_chunks_bound_the_logits_memory(model):
    """With gradients, no chunk's logits are kept for the backward (it recomputes them: checkpointing), so no
    tensor saved for backward has a vocabulary dimension; the head applied in one go saves [64, V] blocks."""
    hidden = torch.randn(64, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.config.vocab_size, (64,))
    head, vocab = model.get_output_embeddings(), model.config.vocab_size

    def saved_shapes(fn):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            result = fn()
        return result, [s for s in shapes if s and s[-1] == vocab and s != tuple(head.weight.shape)]

    chunked, kept = saved_shapes(lambda: logprobs.head_logprobs(head, hidden, targets, 1.0, [], chunk=8))
    assert kept == []
    _, kept_whole = saved_shapes(lambda: logprobs._chunk_logprobs(head, hidden, targets, 1.0, []))
    assert (64, vocab) in kept_whole  # what the chunks avoid
    whole = torch.log_softmax(head(hidden).float(), -1)[torch.arange(64), targets]
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_packed_equals_padded_logprobs_loss_and_gradients(model):
    """One packed row and right-padded rows: the same per-token log-probs, and the same loss and gradients."""
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, batch, 1.0, True),
                                   response_logprobs(model, batch, 1.0, False), atol=1e-5, rtol=0)
    assert_same_gradients(gradients(model, lambda: response_logprobs(model, batch, 1.0, False), weights),
                          gradients(model, lambda: response_logprobs(model, batch, 1.0, True), weights))


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_packed_equals_padded_for_vision_language_models(tmp_path, architecture):
    """Image rows (one and two images), video rows (a video; an image and a video longer than it is wide) and a
    text row packed into one row, with the 3-D M-RoPE positions of each sequence under a row of text positions: each
    sequence's log-probs and the gradients equal those of the padded batch, where the model computes its own
    positions (the trainer's: its adapter's use_original_positions), and those of the sequence alone."""
    path = build_tiny_vlm(architecture, tmp_path / architecture)
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=PACKED_SDPA)
    family(model.config).use_original_positions(model)
    linear_attention_per_sequence(model)  # Qwen3.5's, as fsdp_utils does
    processor = AutoProcessor.from_pretrained(path)
    vocab = processor.tokenizer.convert_tokens_to_ids
    start, pad, end, frames = vocab("<|vision_start|>"), vocab("<|image_pad|>"), vocab("<|vision_end|>"), vocab(
        "<|video_pad|>")
    clip = Video(stripes(8), fps=2.0, indices=list(range(8)), total=8)
    items = [{"prompt_ids": [1, start, pad, end, 40, 41], "images": [Image.new("RGB", (56, 84), (255, 0, 0))]},
             {"prompt_ids": [1, 30, 31], "images": []},
             {"prompt_ids": [1, start, pad, end, 50, start, pad, end],
              "images": [Image.new("RGB", (112, 56), (0, 255, 0)), Image.new("RGB", (56, 56), (0, 0, 255))]},
             {"prompt_ids": [1, start, frames, end, 42], "images": [], "videos": [replace(clip, frames=clip.frames[:4],
                                                                                          indices=[0, 1, 2, 3])]},
             {"prompt_ids": [1, start, pad, end, start, frames, end, 43], "images": [Image.new("RGB", (56, 56))],
              "videos": [clip]}]
    prompts, images = zip(*[expand_prompt(processor, item) for item in items])
    batch = make_batch(list(prompts), [[60, 61, 2], [70, 71, 72, 73, 2], [80], [81, 82], [83, 84, 2]], pad_id=0,
                       vision=list(images))
    with torch.no_grad():
        packed, padded = response_logprobs(model, batch, 1.0, True), response_logprobs(model, batch, 1.0, False)
        alone = [response_logprobs(model, batch.select([b]), 1.0, False)[0] for b in range(len(items))]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, torch.stack(alone), atol=1e-5, rtol=0)
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2))
    assert_same_gradients(gradients(model, lambda: response_logprobs(model, batch, 1.0, False), weights),
                          gradients(model, lambda: response_logprobs(model, batch, 1.0, True), weights))


def test_packed_sdpa_is_sdpa_packed_padded_and_in_generation(model, tmp_path):
    """plumbing/attention.py's per-sequence sdpa against transformers' sdpa: the same log-probs for a packed row (sdpa
    with its block-diagonal mask) and for padded rows, and the same greedy generation from a left-padded batch
    (the hf engine's case: a padding mask, then one token at a time against the KV cache)."""
    reference = AutoModelForCausalLM.from_pretrained(model.name_or_path, attn_implementation="sdpa")
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    with torch.no_grad():
        for padding_free in (True, False):
            torch.testing.assert_close(response_logprobs(model, batch, 1.0, padding_free),
                                       response_logprobs(reference, batch, 1.0, padding_free), atol=1e-5, rtol=0)
        prompts = torch.tensor([[0, 0, 1, 20, 21], [1, 30, 31, 32, 33]])
        mask = (prompts != 0).long()
        generate = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompts, **generate), reference.generate(prompts, **generate))


def test_micro_batch_plans_by_hand(world_of_one):
    assert balanced_bins([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # 8 and 7 tokens
    assert budget_bins([5, 1, 4, 2, 3], 8) == [[0, 1, 3], [2, 4]]
    assert budget_bins([5, 1, 4, 2, 3], 7) == [[0], [1, 2], [3, 4]]  # 15 tokens: 3 bins of 5
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)  # sequence lengths 8, 7, 4, 9, 10
    assert micro_batches(batch, size=2) == [[0, 1], [2, 3], [4]]
    plan = micro_batches(batch, size=2, max_tokens=12)
    assert sorted(i for rows in plan for i in rows) == [0, 1, 2, 3, 4]
    assert all(sum(len(PROMPTS[i]) + len(RESPONSES[i]) for i in rows) <= 12 for rows in plan) and len(plan) == 4


def test_a_rank_with_fewer_micro_batches_repeats_its_last_in_a_no_grad_pass(monkeypatch):
    """Another rank needs 5 micro-batches (the all-reduce stood in): with `repeat` (the no-grad passes) this rank's 5
    rows in micro-batches of 2 make 3, then its last again, to 5; under a budget the heaviest split first, then the
    last repeats; without `repeat` (an update: every rank holds as many rows) a shortfall the splits cannot make up
    is an error, not a repeated gradient."""
    import logprobs

    monkeypatch.setattr(logprobs.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(logprobs.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(logprobs, "all_reduce", lambda values, device, op: {"micro_batches": torch.tensor(6)})
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)  # sequence lengths 8, 7, 4, 9, 10
    assert micro_batches(batch, size=2, repeat=True) == [[0, 1], [2, 3], [4], [4], [4], [4]]
    plan = micro_batches(batch, size=8, max_tokens=20, repeat=True)
    assert len(plan) == 6 and sorted(i for rows in plan[:5] for i in rows) == [0, 1, 2, 3, 4] and plan[5] == plan[4]
    assert micro_batches(batch, size=2) == [[0, 1], [2, 3], [4]]  # no budget, no repeat: no collective either
    with pytest.raises(ValueError, match="a rank needs 6 micro-batches for 5 sequences"):
        micro_batches(batch, size=8, max_tokens=20)


def test_one_micro_batch_of_eight_eight_of_one_and_a_token_budget_give_one_gradient(model, world_of_one):
    """The update's loss over 8 sequences: as one micro-batch, as 8 micro-batches of 1, and as micro-batches by a
    token budget, packed or padded: the same accumulated gradient (exact global normalisation)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(10, 100, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() + [2]
                 for _ in range(8)]
    batch = make_batch(prompts, responses, pad_id=0)
    advantages = torch.randn(8, 1, generator=g) * batch.response_mask
    old = (batched_logprobs(model, batch, 1.0, micro_batch_size=8)
           + 0.2 * torch.randn(batch.response_mask.shape, generator=g))
    results = []
    for size, budget, padding_free in [(8, 0, True), (1, 0, True), (8, 24, True), (8, 0, False), (2, 0, False)]:
        cfg = Config()
        cfg.algorithm.use_kl_loss = False
        cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch = size, budget
        cfg.actor.padding_free = padding_free
        model.zero_grad(set_to_none=True)
        backward_mini_batch(model, replace(batch, old_logprobs=old, advantages=advantages), cfg)
        results.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert len(micro_batches(batch, 8, 24)) > 2  # the budget did split the batch
    for other in results[1:]:
        assert_same_gradients(results[0], other)


def test_on_policy_update_takes_the_old_logprobs_from_its_own_forward(tmp_path, world_of_one):
    """One optimizer step per batch: no separate old-log-prob pass, the same step as with one, and the old log-probs
    it returns (for the engine-gap metric) are the policy's log-probs before the step."""
    path = build_tiny_model("qwen2", tmp_path / "m")
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5], [1.0]]) * batch.response_mask
    cfg = Config()
    cfg.algorithm.use_kl_loss, cfg.rollout.n, cfg.trainer.global_batch_size = False, 5, 1
    weights = []
    for separate_pass in (True, False):
        model = AutoModelForCausalLM.from_pretrained(path)
        before = batched_logprobs(model, batch, 1.0, micro_batch_size=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the step is the gradient (Adam's would be its sign)
        own_old = before if separate_pass else None
        _, old = update_policy(model, optimizer, replace(batch, old_logprobs=own_old, advantages=advantages), cfg)
        torch.testing.assert_close(old, before, atol=1e-6, rtol=0)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*weights)) < 1e-5
    cfg.trainer.ppo_epochs = 2
    with pytest.raises(ValueError, match="old log-probs"):
        update_policy(model, optimizer, replace(batch, advantages=advantages), cfg)


def test_the_engine_gap_metrics_measure_a_known_gap(world_of_one):
    """A positive control for the trainer-engine gap, the guard against a stale engine: engine log-probs off by a
    known amount per token give exactly that mean, max and importance ratio (padding ignored)."""
    batch = make_batch([[1, 5], [1, 6]], [[7, 8, 2], [9]], pad_id=0)  # 4 valid response tokens
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
    off = torch.tensor([[0.1, -0.3, 0.2], [0.0, 9.0, 9.0]])  # trainer minus engine; the 9s sit on padding
    batch.rollout_logprobs = old - off
    batch.old_logprobs = old
    metrics = logprob_metrics(batch)
    assert metrics["rollout/logprob_diff_mean"].item() == pytest.approx((0.1 + 0.3 + 0.2 + 0.0) / 4)
    assert metrics["rollout/logprob_diff_max"].item() == pytest.approx(0.3)
    assert metrics["rollout/is_ratio_mean"].item() == pytest.approx(
        (math.exp(0.1) + math.exp(-0.3) + math.exp(0.2) + 1.0) / 4)


@pytest.mark.parametrize("estimator", ["kl", "abs", "mse", "low_var_kl"])
def test_the_kl_loss_enters_the_update_with_its_sign_and_weight(model, world_of_one, estimator):
    """The update's gradient with the KL loss on (each estimator) against autograd of the loss written out here:
    token-mean of -A * r + beta * k(l, l_ref), with k by its textbook formula. A flipped sign or a missing beta
    changes the gradient."""
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    mask = batch.response_mask
    g = torch.Generator().manual_seed(5)
    advantages = torch.randn(5, 1, generator=g) * mask
    old = batched_logprobs(model, batch, 1.0, micro_batch_size=8)
    ref = old + 0.3 * torch.randn(mask.shape, generator=g)  # a reference the policy has moved away from
    cfg = Config()
    cfg.algorithm.use_kl_loss, cfg.algorithm.kl_penalty, cfg.algorithm.kl_coef = True, estimator, 0.5
    model.zero_grad(set_to_none=True)
    backward_mini_batch(model, replace(batch, old_logprobs=old, ref_logprobs=ref, advantages=advantages), cfg)
    update = {name: p.grad.clone() for name, p in model.named_parameters()}

    def written_out():
        logprobs = response_logprobs(model, batch, 1.0)
        d = logprobs - ref
        k = {"kl": d, "abs": d.abs(), "mse": d.square() / 2, "low_var_kl": torch.exp(-d) + d - 1}[estimator]
        return ((-advantages * torch.exp(logprobs - old) + 0.5 * k) * mask).sum() / mask.sum()

    model.zero_grad(set_to_none=True)
    written_out().backward()
    assert_same_gradients(update, {name: p.grad.clone() for name, p in model.named_parameters()})


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, world_of_one):
    """--actor.gradient-checkpointing through the trainer's own loading and forward: the activations are recomputed
    in the backward, the gradients are those of a forward that kept them."""
    path = str(build_tiny_model("qwen2", tmp_path / "m"))
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model = load_sharded_model(path, torch.device("cpu"), trainable=True, gradient_checkpointing=checkpointing)
        assert model.is_gradient_checkpointing == checkpointing
        (response_logprobs(model, batch, 1.0) * weights).sum().backward()
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
    assert_same_gradients(*grads)


def test_the_no_grad_passes_run_without_dropout(tmp_path, world_of_one):
    """A checkpoint whose config sets dropout: the old and reference log-probs (no-grad passes) run in eval mode, so
    two passes give the same numbers; the update's own forward keeps the model's dropout (train mode after)."""
    path = build_tiny_model("qwen2", tmp_path / "m", attention_dropout=0.5)
    model = load_sharded_model(str(path), torch.device("cpu"), trainable=True)
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    first, second = (batched_logprobs(model, batch, 1.0, micro_batch_size=8) for _ in range(2))
    assert torch.equal(first, second) and model.training
    with torch.no_grad():  # what the same pass gives in train mode: dropout draws differently each time
        assert not torch.equal(response_logprobs(model, batch, 1.0), response_logprobs(model, batch, 1.0))


def test_the_trainer_renormalises_over_what_top_k_then_top_p_kept():
    """sampled_support by hand (tests/test_rollout.py's hf-engine example): logits [2, 1.5, 1, 0, -1, -3], top-k 4
    keeps the first four, p = [.474, .288, .174, .064]; top-p 0.8 drops the last of those (cumulative share from the
    bottom at most 0.2); token 1 then has e^1.5 / (e^2 + e^1.5 + e^1). A sampled token outside the trainer's set
    (rounding apart from the engine's) stays in it. On random logits the trainer's log-probs are the hf engine's."""
    from rollout import _SampledLogprobs

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]] * 2)
    kept = logprobs.sampled_support(logits, torch.tensor([1, 4]), top_k=4, top_p=0.8)
    assert torch.isfinite(kept[0, :3]).all() and torch.isinf(kept[0, 3:]).all()
    assert torch.isfinite(kept[1, [0, 1, 2, 4]]).all() and torch.isinf(kept[1, [3, 5]]).all()  # the target 4 stays
    head = torch.nn.Linear(6, 6, bias=False)
    head.weight.data = torch.eye(6)
    values = logprobs.head_logprobs(head, logits, torch.tensor([1, 1]), 1.0, [], top_k=4, top_p=0.8)
    assert values[0].item() == pytest.approx(1.5 - math.log(math.exp(2) + math.exp(1.5) + math.exp(1)))
    assert logprobs.head_logprobs(head, logits, torch.tensor([1, 1]), 1.0, [])[0].item() == pytest.approx(
        1.5 - torch.logsumexp(logits[0], -1).item())  # no truncation: the full softmax
    g = torch.Generator().manual_seed(0)
    random, targets = torch.randn(16, 50, generator=g) * 3, torch.zeros(16, dtype=torch.long)
    engine = _SampledLogprobs(temperature=0.7, top_p=0.7, top_k=10, placeholders=[])
    engine(torch.zeros(16, 1, dtype=torch.long), random.clone())
    targets = torch.stack([row.argmax() for row in random])  # a token both keep
    head = torch.nn.Linear(50, 50, bias=False)
    head.weight.data = torch.eye(50)
    torch.testing.assert_close(logprobs.head_logprobs(head, random, targets, 0.7, [], top_k=10, top_p=0.7),
                               engine.finish(targets[:, None])[:, 0])
