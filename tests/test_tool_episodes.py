"""Multi-turn tool episodes (tools.py) on the real engines under torchrun, and the `toy_tools` entry point.

tests/tools_worker.py plays episodes whose every turn calls a tool, on two ranks whose episodes last different numbers
of turns (rank 0: 3, rank 1: 1, its tool failing), with a recorder around the engine: token in, token out (each
turn's prompt is the episode so far, exactly; the response is the sampled turns and the rendered tool turns), then
the trainer's batch of the same episodes, with the holes of the tool turns in its mask and a tool's image expanded
into its tokens: the trainer's log-probs match the engine's on every generated token, packed as padded.
"""


import pytest

from conftest import ENGINE_GAP, FAST, over_cases
from launches import launched_run, uses_runs

pytestmark = pytest.mark.slow

TURNS = 3  # tools_worker.MAX_TURNS
BUDGET = {"qwen2_5_bpe": 96, "qwen2_5_vl": 128}  # tools_worker.BUDGET


CASES = [("vllm", "qwen2_5_bpe"), ("hf", "qwen2_5_bpe"), ("vllm", "qwen2_5_vl"), ("hf", "qwen2_5_vl")]


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict:
    """tests/tools_worker.py over every case, in one launch."""
    return over_cases("tests/tools_worker.py", CASES, tmp_path_factory.mktemp("episodes") / "result.json")


@pytest.mark.parametrize("engine, architecture", CASES)
def test_episodes_are_token_in_token_out_in_lockstep_and_the_trainer_scores_them_as_sampled(played, engine,
                                                                                            architecture):
    """Rank 0's episodes run 3 turns, rank 1's end after its first (a failed call, --rollout.max-tool-errors 1),
    yet both ranks make the same engine calls (rank 1 joins turns 2 and 3 with nothing to generate: for the hf
    engine each call gathers the FSDP2 weights, so a rank that skipped one would hang the other until the timeout).
    Every later turn's prompt is the prompt plus the episode's tokens so far, the sampled ids never re-tokenized;
    the tool turns are masked out; a tool's crop of the picture reaches vLLM and the trainer as its image tokens."""
    ranks = played[f"{engine}:{architecture}"]
    assert [r["rank"] for r in ranks] == [0, 1]
    first, second = ranks
    assert first["turns"] == [TURNS] * 12 and set(first["stop_reasons"]) == {"max_turns"}
    assert first["tool_calls"] == [TURNS - 1] * 12 and set(first["tool_errors"]) == {0}
    assert second["turns"] == [1] * 12 and set(second["stop_reasons"]) == {"tool_errors"}
    assert second["tool_errors"] == [1] * 12
    assert first["engine_calls"] == second["engine_calls"] == TURNS, "the ranks must take every turn together"
    for r in ranks:
        assert all(r["checks"].values()), r["checks"]
        assert max(r["lengths"]) <= BUDGET[architecture]
        assert r["gap"] < ENGINE_GAP, "the trainer's log-probs of the generated tokens must match the engine's"
        assert r["packed_vs_padded"] < 1e-5
    # the tool turns are in the responses, masked: most of rank 0's tokens; none of rank 1's (no tool turn)
    assert first["masked_tokens"] > first["generated_tokens"] / 2 and 0 < first["masked_share"] < 1
    assert second["masked_tokens"] == 0
    if architecture == "qwen2_5_vl":  # each of rank 0's 2 tool turns shows a 56 x 56 crop: 4 image tokens, masked
        assert first["tool_images"] == 2 * 12 and first["tool_image_tokens"] == 4 * first["tool_images"]
        assert first["image_slots_in_responses"] == first["tool_image_tokens"] and first["image_slots_masked"]
        assert first["rows_with_vision"] == second["rows_with_vision"] == 12
    else:
        assert first["tool_images"] == 0 and first["rows_with_vision"] == 0


@launched_run()
def toy_tools_two_steps(folder):
    return ["toy_tools", "--rollout.engine", "hf", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
            "--trainer.no-save-final", *FAST, "--algorithm.rollout-correction", "geometric_mask",
            "--algorithm.correction-low", "0.999", "--algorithm.correction-high", "1.001"]


@uses_runs("toy_tools_two_steps")
def test_the_toy_tools_preset_trains_two_steps(runs):
    """`grpo.py toy_tools --rollout.engine hf`, two ranks, two steps (vllm: the preset's whole run, in
    test_learning.py): the episode metrics are logged and sane (at most the preset's --rollout.max-turns 3 turns, a
    share of masked tool tokens, stop reasons that add up), and the engine's log-probs match the trainer's on the
    generated tokens of multi-turn responses."""
    metrics = runs["toy_tools_two_steps"].metrics("toy_tools")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 1 <= m["episode/turns"] <= 3
        assert 0 <= m["episode/tool_calls"] <= m["episode/turns"] and m["episode/tool_errors"] == 0
        assert 0 <= m["episode/masked_share"] < 1
        stops = {key: value for key, value in m.items() if key.startswith("episode/stop_")}
        assert set(stops) == {f"episode/stop_{reason}" for reason in ("answered", "max_turns", "length", "tool_errors")}
        assert sum(stops.values()) == pytest.approx(1.0)
        assert m["rollout/logprob_diff_max"] < ENGINE_GAP
        # geometric masking within 0.1%: the tool's tokens (the engine logs 0 for them) stay out of the mean
        assert m["rollout/correction_masked_sequences"] == 0
    # a random model's turns seldom begin with a digit, and any other turn is the toy parser's call: tool turns happen
    assert all(m["episode/tool_calls"] > 0.5 and m["episode/masked_share"] > 0.5 for m in metrics)
    # the tiny models' chat template does not render `tools`: said once, over both ranks
    assert runs["toy_tools_two_steps"].output().count("warning: the chat template ignores `tools`") == 1


@launched_run()
def hostile_tools(folder):
    return ["toy_tools", "--actor.model-path", "tiny:qwen2_vl", "--rollout.engine", "hf",
            "--rollout.tools", "tests/hostile_tools.py", "--rollout.tool-parser", "tests/hostile_tools.py:parse",
            "--rollout.tool-timeout", "0.2", "--rollout.max-tool-errors", "0", "--rollout.max-turns", "4",
            "--rollout.max-response-length", "1024", "--trainer.total-steps", "1", "--trainer.output-dir", folder,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
            "--trainer.no-save-final", *FAST]


@uses_runs("hostile_tools")
def test_tools_and_turns_that_do_everything_wrong_are_the_models_problem_not_the_runs(runs):
    """tests/hostile_tools.py's tools hang (a rank's stray calls stay bounded: its parser would end the run
    otherwise), return 20 MB of text (cut before it is rendered) or a 30000 x 2 image (refused: Qwen-VL reads no
    aspect ratio of 200 or more), call sys.exit or raise KeyboardInterrupt; its turns are degenerate (2,000 `[`, a
    5,000-digit number) or make the parser raise. The step finishes with every one of them a failed call the model
    read, and no traceback: before, the first degenerate turn ended the run with a RecursionError."""
    run = runs["hostile_tools"]
    [metrics] = run.metrics("toy_tools")
    assert metrics["episode/tool_errors"] > 3 and metrics["episode/turns"] > 2
    assert 0 < metrics["episode/tool_calls"] - metrics["episode/tool_errors"] < 1  # only `huge` succeeds, cut
    assert "Traceback" not in run.output() and "error:" not in run.output()
