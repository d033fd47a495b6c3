"""Rewards: built-ins on hand-written responses (expected numbers computed by hand), user reward files
loaded by path with kwargs, and every malformed result caught with a message naming the culprit."""

import re
import sys
import threading

import datasets
import pytest
import tyro

from data import DataConfig, PromptDataset
from features.env import Episode
from plumbing.tiny import build_tokenizer
from rewards import RewardConfig, RewardError, RewardFunction, Scoring, overlong_penalty, reward_inputs
from rollout import Response
from tasks.math import reward as math_reward
from tasks.r1v import reward as r1v_reward
from tasks.reasoning_gym import reward as reasoning_gym_reward
from tasks.reasoning_gym import rows as reasoning_gym_rows
from tasks.toy import reward as toy_reward


def sample(response: str, ground_truth="7") -> dict:
    row = {"problem": "what is 3 + 4?", "answer": ground_truth}
    return dict(response=response, response_length=len(response.split()), ground_truth=ground_truth,
                prompt="user: what is 3 + 4?\nassistant:", row=row, images=[])


def scores(function: str, responses: list[str], ground_truth="7", **config) -> list[dict[str, float]]:
    reward = RewardFunction(RewardConfig(function, **config))
    return reward([sample(r, ground_truth) for r in responses])


# ----- built-ins -------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, accuracy, concise, overall", [
    ("7", 1.0, 1.0, 1.0),
    (" 7 \n", 1.0, 1.0, 1.0),
    ("77", 1.0, 0.0, 0.5),  # right digit, did not stop
    ("8", 0.0, 1.0, 0.0),  # stopped, wrong digit: stopping only pays with the right digit
    ("x7", 0.0, 0.0, 0.0),
    ("", 0.0, 0.0, 0.0),
])
def test_toy(response, accuracy, concise, overall):
    assert toy_reward(sample(response, "7")) == {"overall": overall, "accuracy": accuracy, "concise": concise}


@pytest.mark.parametrize("response, format_, accuracy, overall", [
    ("<think>3 + 4</think> The answer is \\boxed{7}.", 1.0, 1.0, 1.0),
    ("<think>3 + 4</think> The answer is \\boxed{8}.", 1.0, 0.0, 0.1),  # 0.9 * 0 + 0.1 * 1
    ("The answer is \\boxed{7}.", 0.0, 1.0, 0.9),  # right answer, no <think>: 0.9 * 1 + 0.1 * 0
    ("<think>3 + 4</think> The answer is 7.", 0.0, 0.0, 0.0),  # nothing boxed
    ("<think>\\boxed{8}</think> so \\boxed{7}", 1.0, 1.0, 1.0),  # the last box counts
    ("<think>3 + 4</think> \\boxed{7", 0.0, 0.0, 0.0),  # cut off mid-box
])
def test_math(response, format_, accuracy, overall):
    result = math_reward(sample(response, "7"))
    assert result == {"overall": pytest.approx(overall), "format": format_, "accuracy": accuracy}


@pytest.mark.parametrize("boxed, ground_truth", [
    ("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "1/2"), ("0.5", "\\frac{1}{2}"), ("\\dfrac12", "1/2"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),  # nested braces inside the box
    ("x + 1", "1 + x"), ("7", 7),  # ground truth need not be a string
])
def test_math_grades_equivalent_answers(boxed, ground_truth):
    response = f"<think>...</think> \\boxed{{{boxed}}}"
    assert math_reward(sample(response, ground_truth)) == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}


@pytest.mark.parametrize("boxed", ["\\frac{1}{3}", "0.49", "", "\\frac{", "}}{{\\left(", "a" * 500])
def test_math_wrong_or_garbage_answers_score_zero(boxed):
    response = f"<think>...</think> \\boxed{{{boxed}}}"
    assert math_reward(sample(response, "1/2"))["accuracy"] == 0.0


def test_math_format_weight_kwarg():
    # right answer, no <think>: (1 - 0.2) * 1 + 0.2 * 0 = 0.8
    [result] = scores("math", ["\\boxed{7}"], kwargs={"format_weight": 0.2})
    assert result == {"overall": pytest.approx(0.8), "format": 0.0, "accuracy": 1.0}


def test_math_grading_works_outside_the_main_thread():
    # math_verify's signal-based timeout raises in other threads; we must grade there without one
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward(sample("<think></think>\\boxed{0.5}", "1/2"))))
    thread.start()
    thread.join()
    assert results == [{"overall": 1.0, "format": 1.0, "accuracy": 1.0}]


@pytest.mark.parametrize("response, format_, accuracy, overall", [
    ("<think>count them</think> <answer>3</answer>", 1.0, 1.0, 1.0),
    ("<think>count them</think>\n<answer> 3 </answer>", 1.0, 1.0, 1.0),
    ("<think>count them</think><answer>4</answer>", 1.0, 0.0, 0.5),
    ("<answer>3</answer>", 0.0, 1.0, 0.5),  # no <think>
    ("<think>a</think> <answer>3</answer> trailing", 0.0, 1.0, 0.5),  # text after </answer>
    ("<think>count them</think> <answer>3.0</answer>", 1.0, 1.0, 1.0),  # graded mathematically
    ("3", 0.0, 1.0, 0.5),  # no tags: the whole response is graded, as in EasyR1
    ("", 0.0, 0.0, 0.0),
])
def test_r1v(response, format_, accuracy, overall):
    assert r1v_reward(sample(response, "3")) == {"overall": overall, "format": format_, "accuracy": accuracy}


def test_r1v_non_numeric_answer_compared_as_string():
    assert r1v_reward(sample("<think>look</think><answer>cat</answer>", "cat"))["accuracy"] == 1.0
    assert r1v_reward(sample("<think>look</think><answer>dog</answer>", "cat"))["accuracy"] == 0.0


def task_sample(response: str, row: dict) -> dict:
    return dict(response=response, response_length=len(response), ground_truth=row["answer"], prompt=row["problem"],
                row=row, images=[], videos=[], messages=[{"role": "assistant", "content": response}])


@pytest.fixture(scope="module")
def legs() -> dict:
    """Row 0 of reasoning_gym:leg_counting: 5 grasshoppers, 8 jellyfish, ..., 3 woodlice, 500 legs (test_data.py)."""
    return reasoning_gym_rows("train", "leg_counting")[0]


@pytest.mark.parametrize("response, accuracy, format_, tagged", [
    ("<think>30 + 0 + 24 + ...</think><answer>500</answer>", 1.0, 1.0, 1.0),
    ("<think>add</think>\n<answer> 500 </answer> done.", 1.0, 1.0, 1.0),  # spaces inside the tags, text after them
    ("<answer>500 legs</answer>", 0.375, 0.0, 1.0),  # leg_counting's partial credit: 3 / 8, "500" inside 8 characters
    ("<think>add</think><answer>499</answer>", 0.0, 1.0, 1.0),
    ("500", 0.0, 0.0, 0.0),  # no tags: the verifier gets no answer
    ("<think>add</think><answer>4</answer><answer>500</answer>", 1.0, 0.0, 1.0),  # the last one counts; two: format 0
    ("<think><think>add</think><answer>500</answer>", 1.0, 0.0, 1.0),  # a <think> inside the thought
])
def test_reasoning_gym_scores_the_tagged_answer_with_the_tasks_own_verifier(legs, response, accuracy, format_, tagged):
    expected = {"overall": accuracy, "accuracy": accuracy, "format": format_, "tagged": tagged}
    assert reasoning_gym_reward(task_sample(response, legs)) == expected
    weighted = reasoning_gym_reward(task_sample(response, legs), format_weight=0.2)
    assert weighted == {**expected, "overall": pytest.approx(accuracy + 0.2 * format_)}


def test_reasoning_gym_verifies_with_the_entrys_metadata():
    """countdown row 0, "Calculate 164 using all of these numbers: 66, 34, 98, 54, 6": its verifier evaluates the
    expression with the row's numbers and target (the metadata, generated again), not the stored answer's text."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("countdown", seed=0, size=2048)[0]
    assert (entry["answer"], entry["metadata"]["numbers"], entry["metadata"]["target"]) == (
        "6*(98 - 54) - 34 - 66", [66, 34, 98, 54, 6], 164)
    row = {"problem": entry["question"], "answer": entry["answer"],
           "reasoning_gym": {"dataset": "countdown", "seed": 0, "size": 2048, "index": 0}}
    accuracy = {response: reasoning_gym_reward(task_sample(response, row))["accuracy"] for response in (
        "<answer>(98 - 54) * 6 - 66 - 34</answer>",  # 264 - 100: right, written otherwise
        "<answer>66 + 34 + 98 + 54 + 6</answer>",  # every number, 258: countdown's 0.05
        "<answer>100 + 64</answer>",  # 164 from other numbers: 0.05
        "164")}  # no tags: countdown's 0.01 for no answer
    assert list(accuracy.values()) == [1.0, 0.05, 0.05, 0.01]


def test_reasoning_gym_refuses_a_row_it_cannot_score(legs):
    with pytest.raises(RewardError, match=r"scores rows of --data.train-files reasoning_gym:NAME, and this row has no "
                       r"'reasoning_gym' column \(its columns: \['answer', 'problem'\]\)"):
        reasoning_gym_reward(sample("<answer>7</answer>"))
    partial = {**legs, "reasoning_gym": {"dataset": "leg_counting", "seed": 0}}
    with pytest.raises(RewardError, match=r"lacks \['index', 'size'\], from which the task's entry is generated again"):
        reasoning_gym_reward(task_sample("<answer>500</answer>", partial))
    other = {**legs, "problem": legs["problem"].replace("5 grasshoppers", "6 grasshoppers")}
    with pytest.raises(RewardError, match="makes row 0 .* again as another question than the row's 'problem'"):
        reasoning_gym_reward(task_sample("<answer>506</answer>", other))


def test_reasoning_gym_reward_needs_the_package_at_start_up(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(RewardError, match=r"^--reward.function reasoning_gym needs reasoning-gym: pip install "
                       r"reasoning-gym$"):
        RewardFunction(RewardConfig("reasoning_gym"))


def test_reasoning_gym_through_the_reward_function_keeps_its_keys(legs):
    reward = RewardFunction(RewardConfig("reasoning_gym", kwargs={"format_weight": 0.2}))
    results = reward([task_sample(r, legs) for r in ("<think>.</think><answer>500</answer>", "", "<answer>5</answer>")])
    assert results == [{"overall": pytest.approx(1.2), "accuracy": 1.0, "format": 1.0, "tagged": 1.0},
                       {"overall": 0.0, "accuracy": 0.0, "format": 0.0, "tagged": 0.0},
                       {"overall": 0.0, "accuracy": 0.0, "format": 0.0, "tagged": 1.0}]


def test_builtins_through_reward_function_return_floats_with_fixed_keys():
    results = scores("toy", ["7", "8", " 77"])
    expected = [
        {"overall": 1.0, "accuracy": 1.0, "concise": 1.0},
        {"overall": 0.0, "accuracy": 0.0, "concise": 1.0},
        {"overall": 0.5, "accuracy": 1.0, "concise": 0.0},
    ]
    assert [r.keys() for r in results] == [e.keys() for e in expected]
    assert all(r == pytest.approx(e) for r, e in zip(results, expected))
    assert all(type(v) is float for r in results for v in r.values())


# ----- config ----------------------------------------------------------------------------------------

def test_tyro_parses_kwargs_with_their_types():
    args = ["--kwargs", "format_weight", "0.2", "n", "3", "strict", "False", "name", "abc", "--batch"]
    config = tyro.cli(RewardConfig, args=args)
    assert config.kwargs == {"format_weight": 0.2, "n": 3, "strict": False, "name": "abc"}
    assert type(config.kwargs["n"]) is int and config.batch


def test_the_kwargs_flag_reads_as_key_value_pairs_in_the_help(capsys):
    """tyro's own type line for the dict (`[STR {True,False}|INT|FLOAT|STR [STR ...]]`) told nothing readable."""
    with pytest.raises(SystemExit):
        tyro.cli(RewardConfig, args=["--help"])
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the words, however the lines wrap
    assert "--kwargs [KEY VALUE ...]" in shown and "{True,False}" not in shown and "(default: none)" in shown


def test_unknown_kwarg_fails_at_start_up():
    with pytest.raises(RewardError, match="format_weigth"):
        RewardFunction(RewardConfig("math", kwargs={"format_weigth": 0.2}))
    with pytest.raises(RewardError, match="toy"):
        RewardFunction(RewardConfig("toy", kwargs={"format_weight": 0.2}))


def test_builtin_with_batch_flag_fails_at_start_up():
    with pytest.raises(RewardError, match="--reward.batch"):
        RewardFunction(RewardConfig("math", batch=True))


# ----- user reward files -----------------------------------------------------------------------------

USER_REWARDS = '''
def per_sample(inp, bonus=0.0, scale=1):
    length = float(inp["response_length"])
    return {"overall": scale * len(inp["response"]) + bonus, "length": length, "has_row": "answer" in inp["row"]}

def batch(inputs, bonus=0.0):
    return [{"overall": i + bonus, "prompt_len": len(x["prompt"])} for i, x in enumerate(inputs)]

def raises(inp):
    raise ZeroDivisionError("boom")

def batch_raises(inputs):
    raise ValueError("reward model unreachable")

def no_overall(inp):
    return {"accuracy": 1.0}

def nan(inp):
    return {"overall": float("nan")}

def infinite(inp):
    return {"overall": float("inf")}

def not_a_number(inp):
    return {"overall": "1.0"}

def not_a_dict(inp):
    return 1.0

def keys_change(inp):
    return {"overall": 1.0, inp["response"]: 1.0}

def short_batch(inputs):
    return [{"overall": 1.0}] * (len(inputs) - 1)

def batch_not_a_list(inputs):
    return {"overall": 1.0}

not_callable = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_user_per_sample_reward_gets_kwargs_and_the_whole_input(user_file):
    reward = RewardFunction(RewardConfig(f"{user_file}:per_sample", kwargs={"bonus": 0.5, "scale": 2}))
    assert reward.name == f"{user_file}:per_sample"
    # "ab": 2 * 2 + 0.5; "abcd e": 2 * 6 + 0.5, two words
    assert reward([sample("ab"), sample("abcd e")]) == [
        {"overall": 4.5, "length": 1.0, "has_row": 1.0},
        {"overall": 12.5, "length": 2.0, "has_row": 1.0},
    ]


def test_user_batch_reward_gets_the_list_and_kwargs(user_file):
    reward = RewardFunction(RewardConfig(f"{user_file}:batch", kwargs={"bonus": 10.0}, batch=True))
    prompt_len = len(sample("")["prompt"])
    assert reward([sample("a"), sample("b"), sample("c")]) == [
        {"overall": 10.0 + i, "prompt_len": float(prompt_len)} for i in range(3)
    ]


def test_raising_reward_names_function_sample_response_and_ground_truth(user_file):
    reward = RewardFunction(RewardConfig(f"{user_file}:raises"))
    with pytest.raises(RewardError) as info:
        reward([sample("x" * 200, "42")])
    message = str(info.value)
    assert f"{user_file}:raises" in message and "sample 0" in message and "ZeroDivisionError" in message
    assert "xxxxx" in message and "x" * 100 not in message and "'42'" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_raising_batch_reward_is_chained(user_file):
    reward = RewardFunction(RewardConfig(f"{user_file}:batch_raises", batch=True))
    with pytest.raises(RewardError, match="batch_raises.*unreachable.*2 samples") as info:
        reward([sample("a"), sample("b")])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("function, expected", [
    ("no_overall", "'overall'"),
    ("nan", "overall=nan"),
    ("infinite", "overall=inf"),
    ("not_a_number", "overall='1.0'"),
    ("not_a_dict", "returned 1.0"),
    ("keys_change", "sample 1"),
])
def test_malformed_results_are_rejected(user_file, function, expected):
    reward = RewardFunction(RewardConfig(f"{user_file}:{function}"))
    with pytest.raises(RewardError) as info:
        reward([sample("7"), sample("8")])
    assert function in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("function", ["short_batch", "batch_not_a_list"])
def test_batch_result_of_wrong_length_is_rejected(user_file, function):
    reward = RewardFunction(RewardConfig(f"{user_file}:{function}", batch=True))
    with pytest.raises(RewardError, match=f"{function}.*for 3 samples"):
        reward([sample("a"), sample("b"), sample("c")])


def test_missing_file_function_or_builtin_is_a_clear_error(user_file, tmp_path):
    with pytest.raises(RewardError, match="nowhere.py"):
        RewardFunction(RewardConfig(f"{tmp_path}/nowhere.py:fn"))
    with pytest.raises(RewardError, match="no 'missing'"):
        RewardFunction(RewardConfig(f"{user_file}:missing"))
    with pytest.raises(RewardError, match="not_callable is a int"):
        RewardFunction(RewardConfig(f"{user_file}:not_callable"))
    builtins = "code, math, r1v, reasoning_gym, toy, toy_tools, judge, env, none"
    with pytest.raises(RewardError, match=f"unknown reward 'maths'.*{builtins}"):
        RewardFunction(RewardConfig("maths"))


# ----- DAPO overlong shaping -------------------------------------------------------------------------

def test_overlong_penalty_by_hand():
    # max 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 at 20 (and never below)
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 25)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_overlong_shaping_is_added_to_overall_and_logged():
    reward = RewardFunction(RewardConfig("toy", overlong_buffer=4, overlong_penalty_factor=0.5), max_response_length=20)
    inputs = [sample("7", "7"), sample("7", "7")]
    inputs[0]["response_length"], inputs[1]["response_length"] = 2, 18
    first, second = reward(inputs)
    assert first["overall"] == 1.0 and first["overlong_penalty"] == 0.0
    assert second["overall"] == pytest.approx(1.0 - 0.5 * 0.5) and second["overlong_penalty"] == pytest.approx(-0.25)


def test_overlong_buffer_must_fit_the_response_length():
    with pytest.raises(RewardError, match="--reward.overlong-buffer 8"):
        RewardFunction(RewardConfig("toy", overlong_buffer=8), max_response_length=4)


# ----- time limits and --reward.on-error ---------------------------------------------------------------

MISBEHAVING = """import sys, time


def score(inp):
    if inp["ground_truth"] == "sleeps":
        try:
            time.sleep(3600)
        except Exception:  # a reward's own blanket except cannot swallow the time limit
            pass
    if inp["ground_truth"] == "loops":
        while True:
            pass
    if inp["ground_truth"] == "exits":
        sys.exit("bye")
    return {"overall": 1.0, "accuracy": 1.0}
"""


@pytest.fixture
def misbehaving(tmp_path):
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    return f"{path}:score"


@pytest.mark.parametrize("ground_truth, problem", [("sleeps", "ran past --reward.timeout 0.3s"),
                                                   ("loops", "ran past --reward.timeout 0.3s"),
                                                   ("exits", "called sys.exit('bye')")])
def test_a_call_that_hangs_or_exits_is_a_reward_error_naming_the_sample(misbehaving, ground_truth, problem):
    reward = RewardFunction(RewardConfig(misbehaving, timeout=0.3))
    with pytest.raises(RewardError, match=rf"{re.escape(problem)} on sample 1 .*ground_truth='{ground_truth}'"):
        reward([sample("a"), sample("b", ground_truth)])
    assert reward([sample("a")]) == [{"overall": 1.0, "accuracy": 1.0}]  # a later call has its own full time


def test_on_error_zero_scores_a_failure_zero_on_every_key_reports_it_once_and_counts_it(misbehaving):
    reports = []
    reward = RewardFunction(RewardConfig(misbehaving, timeout=0.3, on_error="zero"), report=reports.append)
    scores = reward([sample("a"), sample("b", "sleeps"), sample("c", "exits"), sample("d")])
    assert scores == [{"overall": 1.0, "accuracy": 1.0, "failed": 0.0},
                      {"overall": 0.0, "accuracy": 0.0, "failed": 1.0},
                      {"overall": 0.0, "accuracy": 0.0, "failed": 1.0},
                      {"overall": 1.0, "accuracy": 1.0, "failed": 0.0}]
    assert len(reports) == 1 and "ran past --reward.timeout 0.3s on sample 1" in reports[0]


def test_results_beyond_float32_are_refused():
    reward = RewardFunction(RewardConfig("toy"))
    assert reward._check(0, sample("7"), {"overall": 3e38}) == {"overall": 3e38}
    with pytest.raises(RewardError, match="overall=1e\\+300, beyond float32's range"):
        reward._check(0, sample("7"), {"overall": 1e300})


def test_outside_the_main_thread_a_reward_runs_without_a_time_limit(misbehaving):
    results = []
    thread = threading.Thread(target=lambda: results.append(
        RewardFunction(RewardConfig(misbehaving, timeout=0.3))([sample("a")])))
    thread.start()
    thread.join()
    assert results == [[{"overall": 1.0, "accuracy": 1.0}]]


# ----- TRL's reward functions, unchanged -------------------------------------------------------------

TRL_REWARDS = '''
import asyncio

seen = []

def accuracy(completions, solution, **kwargs):
    seen.append({"completions": completions, "solution": solution, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if s == "skip" else float(t.strip() == s) for t, s in zip(texts, solution)]

def by_step(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]

def no_kwargs(completions, solution):
    return [float(c == s) for c, s in zip(completions, solution)]

async def length(completions, scale=1.0, **kwargs):
    await asyncio.sleep(0)
    return [scale * len(c) for c in completions]

def vault(completions, environments, **kwargs):
    return [env.reward for env in environments]

def short(completions, **kwargs):
    return [1.0]

def project_batch(inputs):
    return [1.0 for _ in inputs]
'''


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def trl_rollout(tokenizer, rows: list[dict], responses: list[str], prompt_key="prompt", episodes=None) -> tuple:
    """(items, responses): one response a row, the rows rendered by data.py (a TRL dataset: column `prompt`, answers
    in `solution`)."""
    dataset = PromptDataset(datasets.Dataset.from_list(rows), DataConfig(prompt_key=prompt_key, answer_key="solution"),
                            tokenizer, "trl")
    items = [dataset[i] for i in range(len(rows))]
    groups = [[Response(token_ids=tokenizer(text, add_special_tokens=False)["input_ids"], logprobs=[],
                        truncated=False, episode=episodes[i] if episodes else None)]
              for i, text in enumerate(responses)]
    return items, groups


def trl_inputs(tokenizer, rows: list[dict], responses: list[str], prompt_key="prompt", episodes=None) -> list:
    """The reward inputs of trl_rollout's responses."""
    return reward_inputs(tokenizer, *trl_rollout(tokenizer, rows, responses, prompt_key, episodes))


CONVERSATION = [{"role": "system", "content": "Answer with a digit."}, {"role": "user", "content": "3 + 4?"}]


def test_a_trl_reward_function_on_a_conversational_dataset_gets_what_trl_passes(trl_file, tokenizer):
    rows = [{"prompt": CONVERSATION, "solution": "7", "level": 1},
            {"prompt": CONVERSATION, "solution": "skip", "level": 2},
            {"prompt": CONVERSATION + [{"role": "assistant", "content": "It is "}], "solution": "It is 7", "level": 3}]
    inputs = trl_inputs(tokenizer, rows, ["7", "7", "7"])
    reward = RewardFunction(RewardConfig(f"{trl_file}:accuracy"))  # no --reward.batch: TRL's kind is one
    assert reward.batch and reward(inputs) == [{"overall": 1.0, "unscored": 0.0}, {"overall": 0.0, "unscored": 1.0},
                                               {"overall": 1.0, "unscored": 0.0}]
    [seen] = reward.fn.fn.__globals__["seen"]
    assert seen["completions"][:2] == [[{"role": "assistant", "content": "7"}]] * 2
    assert seen["completions"][2] == [{"role": "assistant", "content": "It is 7"}]  # the prefill opens it
    assert seen["prompts"] == [row["prompt"] for row in rows]  # the column as written
    assert (seen["solution"], seen["level"]) == (["7", "skip", "It is 7"], [1, 2, 3])  # every other column
    assert seen["completion_ids"] == [tokenizer("7", add_special_tokens=False)["input_ids"]] * 3
    assert seen["trainer_state"] is reward.trainer_state and seen["trainer_state"].global_step is None
    assert "prompt" not in seen and "environments" not in seen


def test_a_trl_reward_function_on_text_prompts_kwargs_async_and_the_trainer_state(trl_file, tokenizer):
    rows = [{"problem": "3 + 4?", "solution": "7"}, {"problem": "2 + 2?", "solution": "4"}]
    inputs = trl_inputs(tokenizer, rows, ["7", "five"], prompt_key="problem")
    assert RewardFunction(RewardConfig(f"{trl_file}:no_kwargs"))(inputs) == [  # strings; only what it takes
        {"overall": 1.0, "unscored": 0.0}, {"overall": 0.0, "unscored": 0.0}]
    length = RewardFunction(RewardConfig(f"{trl_file}:length", kwargs={"scale": 0.5}))
    assert length.is_async and length(inputs) == [{"overall": 0.5, "unscored": 0.0},
                                                  {"overall": 2.0, "unscored": 0.0}]
    by_step = RewardFunction(RewardConfig(f"{trl_file}:by_step"))
    by_step.trainer_state.max_steps = 4  # grpo.scoring_of: --trainer.total-steps
    groups, scores = Scoring(by_step, tokenizer).start(*trl_rollout(tokenizer, rows, ["7", "five"], "problem"),
                                                       step=3)  # the training loop's round: the steps done
    scores.give(groups)
    assert [g.scores[0]["overall"] for g in groups] == [0.75, 0.75]


def test_a_trl_reward_function_reads_the_episodes_environments(trl_file, tokenizer):
    class Vault:
        def __init__(self, reward):
            self.reward = reward

    episodes = [Episode(messages=[{"role": "assistant", "content": "5"}], environment=Vault(r)) for r in (1.0, 0.25)]
    inputs = trl_inputs(tokenizer, [{"prompt": CONVERSATION, "solution": "5"}] * 2, ["5", "5"], episodes=episodes)
    assert [s["overall"] for s in RewardFunction(RewardConfig(f"{trl_file}:vault"))(inputs)] == [1.0, 0.25]


def test_a_trl_reward_functions_faults_are_named(trl_file, tokenizer):
    inputs = trl_inputs(tokenizer, [{"prompt": "3 + 4?", "solution": "7"}] * 2, ["7", "7"])
    with pytest.raises(RewardError, match="--reward.kwargs \\['trainer_state'\\] are TRL's own arguments"):
        RewardFunction(RewardConfig(f"{trl_file}:accuracy", kwargs={"trainer_state": 1}))
    with pytest.raises(RewardError, match="--reward.kwargs \\['scale'\\] are not among its parameters"):
        RewardFunction(RewardConfig(f"{trl_file}:no_kwargs", kwargs={"scale": 1}))
    no_column = [{**inp, "row": {"prompt": "3 + 4?", "answer": "7"}} for inp in inputs]
    with pytest.raises(RewardError, match=r"takes \['solution'\], neither a column of the dataset \(its columns: "
                                          r"\['answer', 'prompt'\]\)"):
        RewardFunction(RewardConfig(f"{trl_file}:no_kwargs"))(no_column)
    with pytest.raises(RewardError, match="returned 1 results for 2 samples"):
        RewardFunction(RewardConfig(f"{trl_file}:short"))(inputs)
    with pytest.raises(RewardError, match="returned 1.0, expected a dict .* takes a parameter named `completions`"):
        RewardFunction(RewardConfig(f"{trl_file}:project_batch", batch=True))(inputs)
