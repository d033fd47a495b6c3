"""On-policy distillation (`--algorithm.adv-estimator distill --distill.teacher T`): the whole-vocabulary divergences
(--distill.kl reverse / forward) against their textbook formulas, by hand, chunked, packed and through the update; the
entry point with each signal. The sampled signal's estimator by hand is in test_algorithms.py, the teacher's memory in
test_memory.py, what it teaches a fresh student in test_learning.py."""

import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import logprobs
from conftest import FAST, SIGNAL
from features import distillation
from features.distillation import Distillation, divergence_column, divergence_of
from launches import Part, launched_run, uses_runs
from logprobs import make_batch, response_logprobs, response_outputs
from plumbing.memory import CHUNK_TOKENS
from test_logprobs import PROMPTS, RESPONSES, assert_same_gradients, gradients


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen2 student (hidden size 128) and a tiny Qwen3 teacher of the same tokenizer, larger (hidden size 192,
    3 layers), with the trainer's attention."""
    from transformers import AutoModelForCausalLM

    from plumbing.attention import PACKED_SDPA
    from plumbing.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("distill")
    paths = (build_tiny_model("qwen2", folder / "student"),
             build_tiny_model("qwen3", folder / "teacher", hidden_size=192, num_hidden_layers=3))
    return tuple(AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_SDPA).eval() for path in paths)


def identity_head(size: int) -> torch.nn.Linear:
    head = torch.nn.Linear(size, size, bias=False)
    head.weight.data = torch.eye(size)
    return head


def test_the_divergences_and_their_gradients_by_hand():
    """p = [0.5, 0.5] (the student's logits z), q = [0.8, 0.2]: reverse KL(p || q) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2)
    = 0.2231, forward KL(q || p) = 0.8 ln(0.8/0.5) + 0.2 ln(0.2/0.5) = 0.1927. Gradients in z: reverse
    p_i (ln p_i - ln q_i - KL) = [-0.3466, 0.3466], forward p - q = [-0.3, 0.3]; the teacher's side none. The entropy
    column is ln 2 for both; top-k 1 truncates the entropy's distribution, not the divergence's."""
    head = identity_head(2)
    teacher_head = identity_head(2).requires_grad_(False)
    q = torch.tensor([[0.8, 0.2]]).log()
    expected = {"reverse": (0.2231, [-0.3466, 0.3466]), "forward": (0.1927, [-0.3, 0.3])}
    for divergence, (value, gradient) in expected.items():
        z = torch.zeros(1, 2, requires_grad=True)
        out = logprobs._chunk_logprobs(head, z, torch.tensor([0]), 1.0, [], entropy=True,
                                       columns=[divergence_of(teacher_head, q, divergence)])
        out[0, 2].backward()
        assert out[0, 1].item() == pytest.approx(math.log(2), abs=1e-6)
        assert out[0, 2].item() == pytest.approx(value, abs=1e-4)
        assert z.grad[0].tolist() == pytest.approx(gradient, abs=1e-4)
    # z = [1, 0]: p = [0.7311, 0.2689]; top-k 1 keeps one token for the entropy (0), the divergences see all of p
    z, p = torch.tensor([[1.0, 0.0]]), [math.e / (math.e + 1), 1 / (math.e + 1)]
    for divergence, value in {"reverse": sum(a * math.log(a / b) for a, b in zip(p, (0.8, 0.2))),
                              "forward": sum(b * math.log(b / a) for a, b in zip(p, (0.8, 0.2)))}.items():
        kept = logprobs._chunk_logprobs(head, z, torch.tensor([0]), 1.0, [], top_k=1, entropy=True,
                                        columns=[divergence_of(teacher_head, q, divergence)])
        assert kept[0, 1].item() == 0 and kept[0, 2].item() == pytest.approx(value, abs=1e-6)


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_a_teacher_padded_to_more_rows_is_compared_over_the_rows_both_have(divergence):
    """One tokenizer, heads padded to different sizes (a Qwen2.5-7B teacher's 152,064 rows beside a 0.5B student's
    151,936): the first update of --distill.kl forward or reverse failed on the shapes (issue 50). Both distributions
    are over the rows they share, renormalised: a student of 3 rows and a teacher of 5 whose first 3 are the student's
    (its 2 padding rows any values) give 0, either way round; a teacher's q = [0.8, 0.2 | pad] against p = [0.5, 0.5]
    gives the 2-row values by hand."""
    student, padded = identity_head(3), torch.nn.Linear(3, 5, bias=False).requires_grad_(False)
    padded.weight.data = torch.cat([torch.eye(3), torch.randn(2, 3)])
    z = torch.tensor([[0.3, -1.0, 2.0]], requires_grad=True)
    for head, teacher_head in ((student, padded), (padded, student)):
        out = logprobs._chunk_logprobs(head, z, torch.tensor([2]), 0.7, [], entropy=True,
                                       columns=[divergence_of(teacher_head, z.detach(), divergence)])
        assert out.shape == (1, 3) and out[0, 2].abs().item() < 1e-6
    q = torch.tensor([[0.8, 0.2]]).log()
    wide = torch.nn.Linear(2, 4, bias=False).requires_grad_(False)
    wide.weight.data = torch.cat([torch.eye(2), torch.full((2, 2), 5.0)])  # padding rows that would dominate
    out = logprobs._chunk_logprobs(identity_head(2), torch.zeros(1, 2), torch.tensor([0]), 1.0, [], entropy=True,
                                   columns=[divergence_of(wide, q, divergence)])
    assert out[0, 2].item() == pytest.approx({"reverse": 0.2231, "forward": 0.1927}[divergence], abs=1e-4)


def with_teacher(student, teacher, batch, temperature, divergence, padding_free=True):
    """The student's head outputs with the teacher's divergence as its column (the feature's, as the update asks for
    it): the log-probs, the entropies and the divergences [b, R]."""
    column = divergence_column(teacher, divergence)
    head = response_outputs(student, batch, temperature, padding_free, columns=[column])
    return head.logprobs, head.entropy, head.columns[column.name]


def textbook(head, hidden, teacher_head, teacher_hidden, temperature, divergence):
    """The divergence by its formula on the whole [N, V] at once."""
    log_p = (head(hidden).float() / temperature).log_softmax(-1)
    log_q = (teacher_head(teacher_hidden).float() / temperature).log_softmax(-1).detach()
    if divergence == "reverse":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, CHUNK_TOKENS])
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_the_chunked_divergence_is_the_full_softmaxs_values_and_gradients(models, chunk, divergence):
    """Over chunks of 1, 3 and the default 1,024 tokens, each recomputed in the backward, with the teacher's hidden
    states of another size cut alike: the textbook's values and gradients (hidden states and head), at temperature
    0.7 with top-k / top-p on (the divergence is over the whole vocabulary); the teacher's head gets no gradient."""
    student, teacher = models
    head, teacher_head = student.get_output_embeddings(), teacher.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, student.config.hidden_size, generator=g)
    teacher_hidden = torch.randn(10, teacher.config.hidden_size, generator=g)
    targets = torch.randint(0, student.config.vocab_size, (10,), generator=g)
    weights = torch.randn(10, generator=g)

    def run(fn):
        h = hidden.clone().requires_grad_()
        student.zero_grad(set_to_none=True)
        teacher.zero_grad(set_to_none=True)
        values = fn(h)
        (values * weights).sum().backward()
        assert teacher_head.weight.grad is None
        return values.detach(), h.grad, head.weight.grad.clone()

    chunked = run(lambda h: logprobs.head_logprobs(head, h, targets, 0.7, [], chunk, 5, 0.8, entropy=True,
                                                   columns=[divergence_of(teacher_head, teacher_hidden,
                                                                          divergence)])[:, 2])
    full = run(lambda h: textbook(head, h, teacher_head, teacher_hidden, 0.7, divergence))
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert chunked[0].min() > 0


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_packed_and_padded_divergences_agree_and_a_teacher_equal_to_the_student_gives_zero(models, divergence):
    """Through both whole models, the teacher's forward on the same micro-batch (the feature's head column): each
    response token's divergence is the textbook's on the two models' full logits, packed and padded alike, with the
    same gradients; the log-probs beside it are those asked for alone. The student as its own teacher: 0 at every
    token, and no gradient."""
    student, teacher = models
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    mask = batch.response_mask
    with torch.no_grad():
        packed = with_teacher(student, teacher, batch, 0.7, divergence, True)
        padded = with_teacher(student, teacher, batch, 0.7, divergence, False)
        alone = response_logprobs(student, batch, 0.7, True)
        expected = torch.zeros_like(mask)
        for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            ids, at = torch.tensor([p + r]), slice(len(p) - 1, len(p) + len(r) - 1)
            expected[b, : len(r)] = textbook(torch.nn.Identity(), student(ids).logits[0, at], torch.nn.Identity(),
                                             teacher(ids).logits[0, at], 0.7, divergence)
    torch.testing.assert_close(packed[2], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[2], expected, atol=1e-5, rtol=0)
    assert torch.equal(packed[0], alone) and packed[2][mask > 0].min() > 0
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    assert_same_gradients(
        gradients(student, lambda: with_teacher(student, teacher, batch, 0.7, divergence, False)[2], weights),
        gradients(student, lambda: with_teacher(student, teacher, batch, 0.7, divergence, True)[2], weights))
    itself = with_teacher(student, student, batch, 0.7, divergence)[2]
    assert itself.abs().max() < 1e-6
    student.zero_grad(set_to_none=True)
    (itself * weights).sum().backward()
    assert max(p.grad.abs().max().item() for p in student.parameters() if p.grad is not None) < 1e-6


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_the_divergence_enters_the_update_beside_the_outcome_advantage(models, world_of_one, divergence):
    """The update's gradient with a teacher in the loss against autograd of the loss written out here: token-mean of
    -A * r + D(student, teacher), A the outcome advantages (--distill.reward-weight's share), D the divergence by its
    textbook formula; the metric is D's token mean. With the sampled signal the teacher stays out of the loss (the
    feature gives the update no term)."""
    from grpo import Config, backward_mini_batch

    student, teacher = models
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    mask = batch.response_mask
    advantages = torch.randn(5, 1, generator=torch.Generator().manual_seed(5)) * mask
    with torch.no_grad():
        old = response_logprobs(student, batch, 1.0)
    cfg = Config()
    cfg.algorithm.use_kl_loss, cfg.distill.kl = False, divergence
    micro = replace(batch, old_logprobs=old, advantages=advantages)
    student.zero_grad(set_to_none=True)
    distill = Distillation(teacher, cfg.distill)
    sums, _ = backward_mini_batch(student, micro, cfg, loss_terms=distill.loss_terms())
    update = {name: p.grad.clone() for name, p in student.named_parameters()}

    def written_out():
        logprobs_, _, divergences = with_teacher(student, teacher, batch, 1.0, divergence)
        return ((-advantages * torch.exp(logprobs_ - old) + divergences) * mask).sum() / mask.sum()

    student.zero_grad(set_to_none=True)
    loss = written_out()
    loss.backward()
    assert_same_gradients(update, {name: p.grad.clone() for name, p in student.named_parameters()})
    with torch.no_grad():
        divergences = with_teacher(student, teacher, batch, 1.0, divergence)[2]
    assert (sums[f"distill/{divergence}_kl"] / sums["tokens"]).item() == pytest.approx(
        ((divergences * mask).sum() / mask.sum()).item(), rel=1e-5)
    cfg.distill.kl = "sampled"
    distill = Distillation(teacher, cfg.distill)
    assert "distill/sampled_kl" not in backward_mini_batch(student, micro, cfg, loss_terms=distill.loss_terms())[0]

def test_the_sampled_signal_scores_with_the_teachers_raw_distribution(models):
    """The sampled signal's teacher pass (distillation.teacher_logprobs, as the feature runs it) at temperature 1 over
    the whole vocabulary, whatever the sampling's settings: a teacher whose head gives the logits [2, 1, 0] (and -30
    on the other 102 tokens, 102 e^-30 = 1e-11 of the mass) scores each sampled token 1 at 1 - log(e^2 + e^1 + e^0)
    = -1.408 under the passes of temperature 0.5 and top-k 2, where those settings give 2 - log(e^4 + e^2) = -2.127."""
    import copy

    teacher = copy.deepcopy(models[1])
    vocab, hidden = teacher.config.vocab_size, teacher.config.hidden_size
    teacher.lm_head = torch.nn.Linear(hidden, vocab)
    teacher.lm_head.weight.data.zero_()
    teacher.lm_head.bias.data = torch.tensor([2.0, 1.0, 0.0] + [-30.0] * (vocab - 3))
    batch = make_batch([[5, 20, 21], [5, 30]], [[1, 1, 1], [1, 1]], pad_id=0)
    passes = dict(temperature=0.5, top_k=2, top_p=1.0, micro_batch_size=2)
    raw = 1 - math.log(math.e ** 2 + math.e + 1)
    torch.testing.assert_close(distillation.teacher_logprobs(teacher, batch, passes),
                               torch.tensor([[raw] * 3, [raw, raw, 0.0]]), atol=1e-5, rtol=0)
    tempered = 2 - math.log(math.e ** 4 + math.e ** 2)  # what the sampling's settings would give
    torch.testing.assert_close(logprobs.batched_logprobs(teacher, batch, **passes),
                               torch.tensor([[tempered] * 3, [tempered, tempered, 0.0]]), atol=1e-5, rtol=0)


def test_the_sampled_signal_moves_the_student_towards_the_teacher(models, world_of_one):
    """The sampled signal through the step's own code (the feature's estimator_inputs, grpo.advantages,
    backward_mini_batch) and one small SGD step:
    at ratio 1 the loss's gradient is -A grad l with A = l_teacher - l_old, a descent on 1/2 sum (l - l_teacher)^2, so
    each sampled token's log-prob moves towards the teacher's (the squared gap shrinks, and sum A x (l_new - l_old)
    > 0); a signal of the wrong sign moves it away. The logged distill/reverse_kl is the mean of l_old - l_teacher."""
    import copy
    from contextlib import nullcontext

    from algorithms import RewardKL
    from grpo import Config, advantages, backward_mini_batch
    from rewards import Group
    from model.sequence_parallel import NO_SP

    student, teacher = copy.deepcopy(models[0]), models[1]
    batch = make_batch(PROMPTS, RESPONSES, pad_id=0)
    mask = batch.response_mask
    cfg = Config()
    cfg.algorithm.adv_estimator, cfg.algorithm.use_kl_loss, cfg.rollout.n = "distill", False, len(PROMPTS)
    with torch.no_grad():
        batch.old_logprobs = response_logprobs(student, batch, 1.0)  # [B, R]
        teacher_logprobs = distillation.teacher_logprobs(teacher, batch, dict(micro_batch_size=8))
    gap = (teacher_logprobs - batch.old_logprobs) * mask
    assert gap.max() > 0.1 and gap.min() < -0.1  # tokens on both sides: the direction is seen on each
    groups = [Group(item={}, responses=[], scores=[{"overall": 0.0}] * len(PROMPTS))]
    inputs, metrics = Distillation(teacher, cfg.distill).estimator_inputs(batch, dict(micro_batch_size=8),
                                                                          timer=lambda phase: nullcontext())
    torch.testing.assert_close(inputs["teacher_gap"] * mask, gap, atol=0, rtol=0)
    metrics.update(advantages(batch, groups, RewardKL(0.0), cfg, NO_SP, inputs))
    assert metrics["distill/reverse_kl"].item() == pytest.approx((-gap.sum() / mask.sum()).item(), rel=1e-5)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-2)
    backward_mini_batch(student, batch, cfg)
    optimizer.step()
    with torch.no_grad():
        moved = (response_logprobs(student, batch, 1.0) - batch.old_logprobs) * mask  # [B, R]
        after = (response_logprobs(student, batch, 1.0) - teacher_logprobs) * mask
    assert moved.abs().max() > 1e-4  # the step moved the student
    assert (gap * moved).sum() > 0
    assert after.square().sum() < gap.square().sum()


DISTILL = ["--algorithm.adv-estimator", "distill", "--trainer.total-steps", "2", "--trainer.val-freq", "0",
           "--trainer.no-val-before-train", *FAST, *SIGNAL]


@launched_run()
def distill_self(folder):
    """The student's own checkpoint as its teacher, no KL, no weight decay: its sampled signal, then its reverse KL
    over the whole vocabulary in the loss."""
    args = ["--distill.teacher", "tiny:qwen2", "--trainer.output-dir", folder, "--algorithm.no-use-kl-loss",
            "--actor.weight-decay", "0", *DISTILL]
    return [args, [*args, "--distill.kl", "reverse", "--trainer.experiment-name", "reverse"]]


@uses_runs("distill_self")
@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["tiny-qwen2_toy", "reverse"])
def test_a_teacher_equal_to_the_student_teaches_nothing(runs, experiment):
    """Its log-probs are the student's to the bit (the same model, the same passes), while the reward was not flat.
    Sampled: every advantage 0, so no loss, no gradient, and the trained weights are the initial ones. Reverse (its
    forward beside the student's in the update, no pass of its own): at step 1 every token's reverse KL over the
    whole vocabulary is 0, and its gradient is rounding's alone, p - p sum(p) with sum(p) 1 to fp32's last bits (a
    teacher of other weights gives ~1: test_sequence_parallel.py), which AdamW's normalisation still turns into
    steps of the learning rate's size: at step 2 the student is that far from its teacher."""
    run = runs["distill_self"]
    metrics = run.metrics(experiment)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/pg_loss"] == 0 and ("timing/teacher_logprob" in m) == (experiment == "tiny-qwen2_toy")
               for m in metrics)
    assert any(m["train/reward_overall_std"] > 0 for m in metrics)
    if experiment == "reverse":
        assert metrics[0]["distill/reverse_kl"] == 0 and metrics[0]["actor/grad_norm"] < 1e-6
        assert 0 < metrics[1]["distill/reverse_kl"] < 1e-4
        return
    assert all(m["distill/reverse_kl"] == 0 and m["actor/grad_norm"] == 0 for m in metrics)
    initial = load_file(run.folder / "models" / "tiny-qwen2" / "model.safetensors")
    final = load_file(run.folder / experiment / "final" / "model.safetensors")
    assert all(torch.equal(initial[k], final[k]) for k in initial)


@launched_run()
def distill_other(folder):
    """Refused first: a teacher of another tokenizer (Qwen2.5's real one); then a teacher of the same tokenizer and
    other weights (tiny Qwen3), with the outcome reward beside it, 2 mini-batches a step."""
    args = ["--trainer.output-dir", folder, "--distill.reward-weight", "0.5", *DISTILL,
            "--trainer.global-batch-size", "4"]
    return [Part(["--distill.teacher", "tiny:qwen2_5_bpe", *args], 1), ["--distill.teacher", "tiny:qwen3", *args]]


@uses_runs("distill_other")
@pytest.mark.slow
def test_another_teacher_is_learned_from_and_one_of_another_tokenizer_is_refused(runs):
    """The refusal is one line naming the flag; the run's reverse KL to the teacher is positive (a sample's log-ratio
    estimate of it: ~0.09 between two random models), and the loss moves the student."""
    run = runs["distill_other"]
    refused = {line for line in run.output(0).splitlines() if line.startswith("error:")}
    assert len(refused) == 1 and "--distill.teacher" in refused.pop() and "tokenizer is not the student's" in \
        run.output(0)
    metrics = run.metrics("tiny-qwen2_toy")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["actor/optimizer_steps"] == 2 for m in metrics)
    for m in metrics:
        assert m["distill/reverse_kl"] > 0.01 and m["actor/pg_loss"] != 0 and math.isfinite(m["actor/grad_norm"])


def test_the_toy_preset_learns_from_the_default_jobs_final_model():
    """`grpo.py toy_distill` after the default job: its teacher is that run's final folder, in the runs/ folder the
    default job writes (README: the default job), and the flags pass the start-up checks."""
    import grpo

    cfg = grpo.parse_config(["toy_distill"])
    grpo.check_config(cfg, world_size=2)
    default = grpo.parse_config([])
    assert cfg.distill.teacher == f"{default.trainer.output_dir}/{default.trainer.experiment_name}/final"
    assert cfg.actor.model_path == default.actor.model_path and cfg.algorithm.adv_estimator == "distill"


def test_the_console_line_shows_the_kl_to_the_teacher():
    """The step line reads the teacher's KL where a run has one (the reference's `kl` is 0 without a KL loss), and
    is the plain line without a teacher."""
    from plumbing.console import step_line

    metrics = {"train/reward_overall": 0.5, "train/response_length_mean": 2.0, "actor/kl_ref": 0.0,
               "actor/grad_norm": 1.25, "rollout/logprob_diff_mean": 2e-7, "timing/step": 0.7,
               "actor/skipped_steps": 0}
    assert step_line(3, metrics) == ("step    3 | reward 0.500 | len 2.0 | kl 0.0000 | grad 1.250 | engine gap 2.0e-07 "
                                     "| 0.70s")
    assert step_line(3, {**metrics, "distill/forward_kl": 0.029}) == (
        "step    3 | reward 0.500 | len 2.0 | kl 0.0000 | forward kl to the teacher 0.0290 | grad 1.250 "
        "| engine gap 2.0e-07 | 0.70s")
