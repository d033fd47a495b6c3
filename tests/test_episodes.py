"""Multi-turn episodes (env.py) on the real engines under torchrun, and the entry point's episodes.

tests/episodes_worker.py plays episodes whose every turn calls a tool, then episodes of a respond-style environment
class, on two ranks whose episodes last different numbers of turns (rank 0: 3, rank 1: 1, its tool or environment
failing), with a recorder around the engine: token in, token out (each turn's prompt is the episode so far, exactly;
the response is the sampled turns and the rendered answers), then the trainer's batch of the same episodes, with the
holes of the given turns in its mask and a given image expanded into its tokens: the trainer's log-probs match the
engine's on every generated token, packed as padded. Through `grpo.py`: the tool task's preset, tools and a parser
that do everything wrong, a TRL-shaped environment class, a TextArena game and the built-in environment task.
"""


import pytest

from conftest import ENGINE_GAP, FAST, over_cases
from launches import launched_run, uses_runs

pytestmark = pytest.mark.slow

TURNS = 3  # episodes_worker.MAX_TURNS
BUDGET = {"qwen2_5_bpe": 96, "qwen2_5_vl": 128}  # episodes_worker.BUDGET


CASES = [("vllm", "qwen2_5_bpe"), ("hf", "qwen2_5_bpe"), ("vllm", "qwen2_5_vl"), ("hf", "qwen2_5_vl")]


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict:
    """tests/episodes_worker.py over every case, in one launch."""
    return over_cases("tests/episodes_worker.py", CASES, tmp_path_factory.mktemp("episodes") / "result.json")


@pytest.mark.parametrize("engine, architecture", CASES)
def test_tool_episodes_are_token_in_token_out_in_lockstep_and_the_trainer_scores_them_as_sampled(played, engine,
                                                                                                 architecture):
    """Rank 0's episodes run 3 turns, rank 1's end after its first (a failed call, --rollout.max-env-errors 1),
    yet both ranks make the same engine calls (rank 1 joins turns 2 and 3 with nothing to generate: for the hf
    engine each call gathers the FSDP2 weights, so a rank that skipped one would hang the other until the timeout).
    Every later turn's prompt is the prompt plus the episode's tokens so far, the sampled ids never re-tokenized;
    the tool turns are masked out; a tool's crop of the picture reaches vLLM and the trainer as its image tokens."""
    ranks = played[f"{engine}:{architecture}"]
    assert [r["rank"] for r in ranks] == [0, 1]
    first, second = (r["tools"] for r in ranks)
    assert first["turns"] == [TURNS] * 12 and set(first["stop_reasons"]) == {"max_turns"}
    assert first["calls"] == [TURNS - 1] * 12 and set(first["errors"]) == {0}
    assert second["turns"] == [1] * 12 and set(second["stop_reasons"]) == {"errors"}
    assert second["errors"] == [1] * 12
    assert first["engine_calls"] == second["engine_calls"] == TURNS, "the ranks must take every turn together"
    for r in (first, second):
        assert all(r["checks"].values()), r["checks"]
        assert max(r["lengths"]) <= BUDGET[architecture]
        assert r["gap"] < ENGINE_GAP, "the trainer's log-probs of the generated tokens must match the engine's"
        assert r["packed_vs_padded"] < 1e-5
    # the tool turns are in the responses, masked: most of rank 0's tokens; none of rank 1's (no tool turn)
    assert first["masked_tokens"] > first["generated_tokens"] / 2 and 0 < first["masked_share"] < 1
    assert second["masked_tokens"] == 0
    if architecture == "qwen2_5_vl":  # each of rank 0's 2 tool turns shows a 56 x 56 crop: 4 image tokens, masked
        assert first["given_images"] == 2 * 12 and first["given_image_tokens"] == 4 * first["given_images"]
        assert first["image_slots_in_responses"] == first["given_image_tokens"] and first["image_slots_masked"]
        assert first["rows_with_vision"] == second["rows_with_vision"] == 12
    else:
        assert first["given_images"] == 0 and first["rows_with_vision"] == 0


@pytest.mark.parametrize("engine, architecture", CASES)
def test_an_environments_episodes_are_token_in_token_out_in_lockstep_and_scored_as_sampled(played, engine,
                                                                                          architecture):
    """A respond-style environment class with state across turns (it counts them): reset's answer ends the prompt's
    open user turn, each turn gets its answer; on rank 0 it never says done (3 turns, max_turns), on rank 1 its first
    answer raises or hangs past --rollout.env-timeout (1 turn, stop reason errors), and the ranks still take every turn
    together. Token in, token out; every turn reached the environment, the last too; the trainer's log-probs match the
    engine's on the generated tokens; the vision-language model reads the environment's pictures."""
    first, second = (r["game"] for r in played[f"{engine}:{architecture}"])
    assert first["turns"] == [TURNS] * 12 and set(first["stop_reasons"]) == {"max_turns"}
    assert first["calls"] == [1 + TURNS] * 12 and set(first["errors"]) == {0}  # reset and every turn's respond
    assert second["turns"] == [1] * 12 and set(second["stop_reasons"]) == {"errors"} and second["errors"] == [1] * 12
    assert first["engine_calls"] == second["engine_calls"] == TURNS, "the ranks must take every turn together"
    for r in (first, second):
        assert all(r["checks"].values()) and r["saw_every_turn"], r["checks"]
        assert max(r["lengths"]) <= BUDGET[architecture]
        assert r["gap"] < ENGINE_GAP and r["packed_vs_padded"] < 1e-5
        assert r["masked_tokens"] > 0  # reset's answer, at least
    if architecture == "qwen2_5_vl":  # rank 0's 2 answers shown each bring a 56 x 56 picture: 4 image tokens, masked
        assert first["given_images"] == 2 * 12 and first["given_image_tokens"] == 4 * first["given_images"]
        assert first["image_slots_in_responses"] == first["given_image_tokens"] and first["image_slots_masked"]
        assert second["given_images"] == 0
    else:
        assert first["given_images"] == 0


@launched_run()
def toy_tools_two_steps(folder):
    return ["toy_tools", "--rollout.engine", "hf", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
            "--trainer.no-save-final", *FAST, "--algorithm.rollout-correction", "geometric_mask",
            "--algorithm.correction-low", "0.999", "--algorithm.correction-high", "1.001"]


@uses_runs("toy_tools_two_steps")
def test_the_toy_tools_preset_trains_two_steps(runs):
    """`grpo.py toy_tools --rollout.engine hf`, two ranks, two steps (vllm: test_episodes.py's worker and the preset's
    whole run in the benchmark, docs/tools.md): the episode metrics are logged and sane (at most the preset's
    --rollout.max-turns 3 turns, a share of masked tool tokens, stop reasons that add up), and the engine's log-probs
    match the trainer's on the generated tokens of multi-turn responses."""
    metrics = runs["toy_tools_two_steps"].metrics("toy_tools")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 1 <= m["episode/turns"] <= 3
        assert 0 <= m["episode/calls"] <= m["episode/turns"] and m["episode/errors"] == 0
        assert 0 <= m["episode/masked_share"] < 1
        stops = {key: value for key, value in m.items() if key.startswith("episode/stop_")}
        assert set(stops) == {f"episode/stop_{reason}" for reason in ("done", "max_turns", "length", "errors")}
        assert sum(stops.values()) == pytest.approx(1.0)
        assert m["rollout/logprob_diff_max"] < ENGINE_GAP
        # geometric masking within 0.1%: the tool's tokens (the engine logs 0 for them) stay out of the mean
        assert m["rollout/correction_masked_sequences"] == 0
    # a random model's turns seldom begin with a digit, and any other turn is the toy parser's call: tool turns happen
    assert all(m["episode/calls"] > 0.5 and m["episode/masked_share"] > 0.5 for m in metrics)
    # the tiny models' chat template does not render `tools`: said once, over both ranks
    assert runs["toy_tools_two_steps"].output().count("warning: the chat template ignores `tools`") == 1


@launched_run()
def hostile_tools(folder):
    return ["toy_tools", "--actor.model-path", "tiny:qwen2_vl", "--rollout.engine", "hf",
            "--tools.functions", "tests/hostile_tools.py", "--tools.parser", "tests/hostile_tools.py:parse",
            "--tools.timeout", "0.2", "--rollout.max-env-errors", "0", "--rollout.max-turns", "4",
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
    assert metrics["episode/errors"] > 3 and metrics["episode/turns"] > 2
    assert 0 < metrics["episode/calls"] - metrics["episode/errors"] < 1  # only `huge` succeeds, cut
    assert "Traceback" not in run.output() and "error:" not in run.output()


@launched_run()
def trl_environment(folder):
    return ["toy_tools", "--rollout.env", "tests/trl_env.py:Echo", "--tools.functions", "", "--tools.parser",
            "tests/trl_env.py:every_turn", "--reward.function", "env", "--rollout.max-turns", "2",
            "--rollout.max-response-length", "64", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
            "--trainer.no-save-final", *FAST]


@uses_runs("trl_environment")
def test_a_trl_environment_class_trains_unchanged(runs):
    """tests/trl_env.py's Echo, written as TRL's guide writes one (reset(**kwargs), a documented tool method, the score
    in `reward`), through `grpo.py --rollout.env`: two steps on vLLM, two turns an episode (each a call of its tool:
    its answer shown after the first, the last not run), reset's answer and the tool's masked, the score the class kept
    (`--reward.function env`) as the reward."""
    metrics = runs["trl_environment"].metrics("toy_tools")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["episode/turns"] == 2 and m["episode/calls"] == 2 and m["episode/errors"] == 0  # reset, one echo
        assert m["episode/stop_max_turns"] == 1 and 0.5 < m["episode/masked_share"] < 1
        assert 0 <= m["train/reward_overall"] <= 1 and m["rollout/logprob_diff_max"] < ENGINE_GAP


@launched_run()
def textarena_game(folder):
    return ["--rollout.env", "textarena:GuessTheNumber-v0", "--data.train-files", "seeds", "--reward.function", "env",
            "--rollout.engine", "hf", "--rollout.max-turns", "3", "--rollout.max-turn-tokens", "4",
            "--rollout.max-response-length", "640", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
            "--trainer.experiment-name", "guess", "--trainer.val-freq", "0", "--trainer.no-val-before-train",
            "--trainer.save-freq", "0", "--trainer.no-save-final", *FAST]


@uses_runs("textarena_game")
def test_a_textarena_game_trains_two_steps(runs):
    """`--rollout.env textarena:GuessTheNumber-v0` on the `seeds` rows, two steps on the hf engine: the game's rules
    (reset's answer, hundreds of tokens) end the prompt's user turn, masked; a random model's turn is no `[number]`, an
    invalid move that ends the game at once (stop reason done) with the game's reward for it, 0."""
    metrics = runs["textarena_game"].metrics("guess")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 1 <= m["episode/turns"] <= 3 and m["episode/errors"] == 0 and m["episode/masked_share"] > 0.9
        assert m["episode/stop_done"] + m["episode/stop_length"] + m["episode/stop_max_turns"] == pytest.approx(1)
        assert m["train/reward_overall"] == 0 and m["rollout/logprob_diff_max"] < ENGINE_GAP


@launched_run()
def toy_env_two_steps(folder):
    return ["toy_env", "--rollout.engine", "hf", "--trainer.total-steps", "2", "--trainer.output-dir", folder,
            "--trainer.val-freq", "0", "--trainer.no-val-before-train", "--trainer.save-freq", "0",
            "--trainer.no-save-final", *FAST]


@uses_runs("toy_env_two_steps")
def test_the_toy_env_preset_trains_two_steps_on_the_hf_engine(runs):
    """`grpo.py toy_env --rollout.engine hf` (vllm: the preset's learning run, test_learning.py): two turns an episode,
    the vault's clue masked, its score the reward."""
    metrics = runs["toy_env_two_steps"].metrics("toy_env")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["episode/turns"] == 2 and m["episode/calls"] == 3 and m["episode/errors"] == 0
        assert m["episode/stop_done"] + m["episode/stop_length"] == pytest.approx(1)
        assert 0.5 < m["episode/masked_share"] < 1 and m["rollout/logprob_diff_max"] < ENGINE_GAP
