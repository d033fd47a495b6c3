"""Ulysses sequence parallelism (sequence_parallel.py): the cut of a packed row by hand; under torchrun (2 ranks,
gloo, FSDP2) log-probs and gradients with the row split over the ranks equal to each rank computing it whole; and
training runs with split rows equal to the same runs without."""

import json
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from conftest import FAST, SIGNAL, torchrun, write_mixed_rows
from launches import launched_run, uses_runs
from logprobs import forward_inputs, make_batch, response_logprobs
from plumbing.attention import PACKED_SDPA
from plumbing.tiny import build_tiny_model, build_tiny_vlm
from model.sequence_parallel import SequenceParallel


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen2", tmp_path_factory.mktemp("m") / "m"),
                                                attn_implementation=PACKED_SDPA)


def test_the_cut_of_a_row_by_hand():
    """6 tokens over 2 ranks: no padding, [0, 3) and [3, 6); over 4: 2 tokens of padding, slices of 2."""
    assert [SequenceParallel(2).padding(n) for n in (6, 7)] == [0, 1]
    assert SequenceParallel(2, 1).bounds(6) == (3, 6) and SequenceParallel(4, 3).bounds(8) == (6, 8)


@pytest.mark.parametrize("size, rank, packed, index, slots", [
    (1, 0, [4, 2], [1, 2, 4], [0, 1, 2]),  # off: the whole row (logprobs.forward_inputs' own example)
    (2, 0, [4, 2], [1, 2], [0, 1]),  # positions 0-2 predict the first sequence's 8 and 9
    (2, 1, [4, 2], [1], [2]),  # positions 3-5: position 4 (local 1) predicts 10
    (4, 1, [4, 2, 2], [0], [1]),  # padded to 8, slices of 2: positions 2-3 predict 9
    (4, 3, [4, 2, 2], [], []),  # the padding's slice predicts nothing
])
def test_forward_inputs_give_each_rank_the_response_tokens_its_slice_predicts(model, size, rank, packed, index, slots):
    """Prompts [5, 6] and [7] with responses [8, 9] and [10], packed: [[5, 6, 8, 9, 7, 10]]."""
    batch = make_batch([[5, 6], [7]], [[8, 9], [10]], pad_id=0)
    inputs, got_index, got_slots = forward_inputs(model, batch, True, SequenceParallel(size, rank))
    assert inputs["packed_lengths"] == packed and inputs["cu_seq_lens_q"].tolist() == [0, 4, 6, 8][: len(packed) + 1]
    assert inputs["input_ids"].shape[1] == sum(packed) and inputs["max_length_q"] == 4
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1][: sum(packed)]]
    assert got_index.tolist() == index and got_slots.tolist() == slots
    assert "sequence_parallel" not in inputs  # the language model's pre-hook gives it (sequence_parallel.hooked)


@dataclass
class Recording(SequenceParallel):
    """A group of 2 seen from rank 0 that records which attention modules attend through it. No process group: for
    the all-to-all's shapes it attends on its slice twice over, and keeps the first half (values beside the point)."""

    seen: list = field(default_factory=list)

    def attend(self, attention, module, query, key, value, attention_mask, **kwargs):
        self.seen.append(type(module).__name__)
        query, key, value = (torch.cat([t, t], dim=2) for t in (query, key, value))
        output, weights = attention(module, query, key, value, attention_mask, **kwargs)
        return output[:, : output.shape[1] // 2], weights

    def gather(self, values):
        return values


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl"])
def test_only_the_language_models_attention_gets_the_group(tmp_path, architecture):
    """transformers hands a model's forward kwargs on to the vision tower's attention blocks too. The group must
    reach the language model's attention layers only: the vision tower runs whole on every rank (its rows are not
    cut), and under flash-attn's varlen kernel (its output uninitialised outside the cu_seqlens it is given) a
    vision attention between the group's all-to-alls gives every rank but the first garbage image embeddings."""
    from sp_worker import vision_batch

    path = build_tiny_vlm(architecture, tmp_path / "vl")
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=PACKED_SDPA)
    sp = Recording(2, 0)
    response_logprobs(model, vision_batch(str(path), torch.device("cpu")), 1.0, sp=sp)
    layers = model.config.get_text_config().num_hidden_layers
    assert len(sp.seen) == layers and all("Vision" not in name for name in sp.seen), sp.seen


SPLIT_CASES = ["qwen2", "qwen2_4_heads", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(scope="module")
def split_rows(tmp_path_factory) -> dict:
    """tests/sp_worker.py over every case, in one launch."""
    out = tmp_path_factory.mktemp("split") / "result.json"
    torchrun(["tests/sp_worker.py", ",".join(SPLIT_CASES), str(out)])
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_rows_give_the_log_probs_and_gradients_of_whole_ones(split_rows, case):
    """tests/sp_worker.py: rows of uneven lengths (an odd total, so the row is padded), for the text model with 1
    key/value head for 2 query heads (repeated for the 2 ranks), the same with 4 query heads (2 a rank: heads and
    sequence swapped wrongly in the all-to-all would mix them) and for each Qwen-VL with rows holding images, videos
    and neither (the cut falls where the lengths put it, inside an image's tokens or not)."""
    result = split_rows[case]
    assert result["logprobs"] < 1e-5 and result["gradients"] < 1e-5 and not result["missing"], result
    assert result["gradient_scale"] > 1  # gradients that are there to compare
    assert result["heads"] == (4 if case == "qwen2_4_heads" else 2)


def split_and_whole(folder, flags: list) -> list[list]:
    """The same 2-step job with its rows cut over groups of 2 ranks (experiment `split`), then without (`whole`)."""
    return [["--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.experiment-name", name,
             "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.no-save-final", *FAST, *flags,
             *(["--actor.sequence-parallel-size", "2"] if name == "split" else [])] for name in ("split", "whole")]


def assert_same_training(run):
    """The same samples (each rank generated its own prompts either way), so the same losses, KL, gradient norms and
    rewards, step after step: the split rows train exactly as whole ones."""
    split, whole = run.metrics("split"), run.metrics("whole")
    assert len(split) == len(whole) == 2
    for a, b in zip(split, whole):
        keys = [k for k in b if k.startswith(("actor/", "train/", "rollout/logprob", "rollout/correction"))]
        assert keys and all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in keys), (a, b)


@launched_run()
def split_text_rows(folder):
    return split_and_whole(folder, [*SIGNAL, "--actor.max-tokens-per-micro-batch", "260",  # 2 micro-batches
                                    "--reward.model", "tiny:qwen2_rm",
                                    "--algorithm.rollout-correction", "sequence_mask",
                                    "--algorithm.adv-estimator", "distill", "--distill.teacher", "tiny:qwen3",
                                    "--distill.kl", "forward", "--distill.reward-weight", "1"])


@uses_runs("split_text_rows")
@pytest.mark.slow
def test_two_ranks_with_split_rows_train_as_two_ranks_without(runs):
    """`torchrun --nproc_per_node 2 grpo.py --actor.sequence-parallel-size 2` (one group of 2: both ranks train on
    both ranks' rollouts, each on half of every row) against the same job with 2 data-parallel ranks, a reward
    model scoring beside the function (each rank's own rollouts, before they are shared: the same scores),
    sequence-level masked importance weights (computed on the whole rows: the same weights) and a distillation
    teacher's forward KL in the loss beside GRPO's advantage (the teacher's rows cut as the student's, its head on
    the tokens of each rank's slice)."""
    assert_same_training(runs["split_text_rows"])
    split = runs["split_text_rows"].metrics("split")
    assert all("train/reward_model" in step and step["distill/forward_kl"] > 0.01 for step in split)


@launched_run(nproc=4)
def split_vision_rows(folder):
    data, _ = write_mixed_rows(folder)
    return split_and_whole(folder, ["--actor.model-path", "tiny:qwen2_5_vl", "--data.train-files", data,
                                    "--data.val-files", "", "--data.image-dir", folder, "--data.no-shuffle",
                                    "--data.video-fps", "4", "--rollout.engine", "hf",
                                    "--trainer.dist-timeout-minutes", "2"])


@uses_runs("split_vision_rows")
@pytest.mark.slow
def test_four_ranks_two_by_two_on_mixed_vision_rows(runs):
    """4 ranks as 2 groups of 2, the tiny Qwen2.5-VL on image, video and text rows: in step 1 one group holds only
    text rows while the other runs the vision tower (no hang), and the run trains as 4 data-parallel ranks do."""
    assert_same_training(runs["split_vision_rows"])
