"""Rewards: turn decoded responses into scores,
`{"overall": float, <sub-score>: float, ...}` per sample.

Design decisions:
- A reward is a plain function, either a built-in below (toy, math, r1v, toy_tools, code,
  reasoning_gym, judge, env, none) or a user's `path/to/file.py:function`. Per-sample kind:
  fn(RewardInput, **kwargs) -> dict; batch kind (`--reward.batch`, e.g. for a reward model):
  fn(list[RewardInput], **kwargs) -> list[dict]; TRL's kind, told by a parameter named
  `completions`, run unchanged (TRLReward): fn(completions, **kwargs) -> list[float | None].
- The input carries everything users ask for: response, its token length, ground truth, the prompt,
  the whole dataset row, its images and videos, and a multi-turn episode's messages, record and
  environment.
- `overall` is the reward; every other key (format, accuracy, ...) is logged as mean/std and can be
  the dynamic-sampling key, so all samples must return the same keys.
- Every result is checked (dict with `overall`, finite real numbers within float32's range, right
  batch length), and every call is timed (`--reward.timeout`). A bad result, a call that raises,
  exits or runs too long raises RewardError naming the function, the sample index, its response and
  ground truth: a NaN reward silently poisons the advantages, and a hung reward would hang every
  rank at the next collective, so we stop at the sample that caused it; or
  (`--reward.on-error zero`) the sample scores 0, reported once and counted in a `failed` key;
  (`skip-group`) its whole group leaves the step and more prompts are drawn.
- Kwargs are checked against the function's signature at start-up, not at the first rollout.
- What a reader of RL does not need lives in plumbing/: the time limits and the async loop
  (plumbing/calls.py), the judge's HTTP client (plumbing/judge.py), loading a user's file
  (plumbing/loading.py); a reward model's forward is logprobs.py's (reward_model_scores), which
  Scoring is given.

Use: `--reward.function math --reward.kwargs format_weight 0.2`
  or `--reward.function my_rewards.py:score --reward.batch`.
"""

import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from math import isfinite
from numbers import Real
from typing import Annotated, Any, Literal, TypedDict

import tyro
from math_verify import parse, verify
from math_verify.errors import TimeoutException

from data import reasoning_gym_entry, reasoning_gym_task
from plumbing.calls import CallTimeout, Deadline, EventLoop, Raised
from plumbing.judge import JudgeClient, JudgeError
from plumbing.loading import load_object, load_template
from plumbing.sandbox import Limits, protections, run_code


@dataclass
class RewardConfig:
    function: str = "toy"
    """Reward function: a built-in name (toy, math, r1v, toy_tools, code, reasoning_gym: a
    reasoning-gym task's own verifier, judge, env: the score the episode's environment keeps),
    `path/to/file.py:function_name` (this project's kind, or TRL's: `def f(completions, **kwargs)`
    returning a float a sample), or none (every sample 0: the reward model's score alone)."""
    kwargs: Annotated[dict[str, bool | int | float | str], tyro.conf.arg(metavar="[KEY VALUE ...]",
                      help_behavior_hint="(default: none)")] = field(default_factory=dict)
    """Keyword arguments passed to the reward function, as KEY VALUE pairs:
    `--reward.kwargs format_weight 0.2`. Each VALUE is read as a boolean (true or false, any case),
    an int, a float, or else a string."""
    batch: bool = False
    """True: fn(list[RewardInput], **kwargs) -> list[dict];
    False: fn(RewardInput, **kwargs) -> dict, called per sample. Either may be an `async def`.
    A TRL reward function is a batch one without it."""
    max_concurrency: int = 32
    """Async rewards (code and judge included): calls running at once on each rank."""
    model: str = ""
    """A reward model: a Hugging Face sequence-classification checkpoint (a Bradley-Terry reward
    model) whose score of each whole sequence becomes the key `model` (it needs the policy's
    tokenizer)."""
    weights: dict[str, float] = field(default_factory=dict)
    """overall = the sum of weight x score over these keys, e.g.
    `--reward.weights overall 1 model 0.5` (overall: the function's own, logged as `function` then);
    empty: the function's overall, plus the model's score if any."""
    judge_url: str = ""
    """judge: the OpenAI-compatible endpoint the judge model serves at, e.g.
    http://127.0.0.1:8000/v1 (vllm serve); asked for its models at start-up, so that a URL where
    nothing answers ends the run before training."""
    judge_model: str = ""
    """judge: the model's name at that endpoint (empty: the first it lists)."""
    judge_template: str = "templates/judge.jinja"
    """judge: the Jinja template of the judge's prompt, given prompt, response, ground_truth and
    row."""
    judge_parser: str = r"-?\d+(?:\.\d+)?"
    """judge: a regular expression whose last match in the reply is the score, or
    path/to/file.py:function (reply text -> a float, or a dict of scores with overall)."""
    judge_request: str = ""
    """judge: JSON fields added to each request, e.g. '{"max_tokens": 8}' or vLLM's
    '{"structured_outputs": {"choice": ["0", "1"]}}'."""
    judge_retries: int = 3
    """judge: retries of a request that fails to connect, times out or gets a 5xx or 429 (with
    backoff)."""
    judge_timeout: float = 30.0
    """judge: seconds one request may take, the start-up one's too (--reward.timeout bounds a
    sample's call, retries included)."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_response_length - this many tokens are
    penalised (0: off)."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: weight of the penalty (which goes from 0 to -1 across the buffer)."""
    timeout: float = 120.0
    """Seconds one call may run (a sample's, or the whole batch's with --reward.batch); 0: no
    limit."""
    on_error: Literal["raise", "zero", "skip-group"] = "raise"
    """A call that times out, raises or returns a bad result: end the run naming the sample (raise),
    score it 0, counted in reward_failed (zero), or leave its whole group out of the step, counted
    in rollout/skipped_groups (skip-group: more prompts are drawn to fill the batch, as dynamic
    sampling does)."""


class RewardInput(TypedDict):
    response: str  # decoded response, special tokens stripped
    response_length: int  # in tokens
    response_ids: list[int]  # its tokens (a multi-turn episode's, the given turns' included)
    ground_truth: Any  # the dataset's answer column, as stored
    prompt: str  # the chat-formatted prompt text
    row: dict  # the whole dataset row, all columns
    images: list  # PIL images of the row; empty for text
    # the row's videos (vision.Video: frames [T, H, W, 3] uint8, fps, indices); empty for text
    videos: list
    # the turns after the prompt: one assistant turn, or a multi-turn episode's (env.Episode)
    messages: list[dict]
    # a multi-turn episode's record (env.Episode: turns, calls, errors, stop reason);
    # None for one turn
    episode: Any
    # the episode's environment object (--rollout.env, one per episode), which may keep the score;
    # or None
    env: Any


class RewardError(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------------------

def toy_reward(inp: RewardInput) -> dict[str, float]:
    """The built-in task's reward: the right digit first (accuracy), and then stopping right there
    (concise).

    overall = 0.5 accuracy + 0.5 accuracy * concise; accuracy: the stripped response starts with the
    answer; concise: it is exactly as long as the answer (the model emitted EOS right after it).
    Stopping only pays once the digit is right, so the model first learns the task, then to stop.
    ground truth "7": "7" -> 1.0; "77" -> 0.5 (right, did not stop); "8" -> 0.0; "" -> 0.0.
    """
    response, answer = inp["response"].strip(), str(inp["ground_truth"])
    accuracy = float(response.startswith(answer))
    concise = float(len(response) == len(answer))
    return {"overall": 0.5 * accuracy + 0.5 * accuracy * concise, "accuracy": accuracy,
            "concise": concise}


def math_reward(inp: RewardInput, format_weight: float = 0.1) -> dict[str, float]:
    """EasyR1's math reward: the last \\boxed{} graded against the ground truth, plus a format
    bonus.

    ground truth "1/2": "<think>..</think> so \\boxed{\\frac{1}{2}}" -> format 1, accuracy 1,
    overall 1.0; "\\boxed{0.5}" (no <think>) -> format 0, accuracy 1,
    overall 0.9 = (1 - 0.1) * 1 + 0.1 * 0.
    """
    response = inp["response"].strip()
    format_ok = float(
        re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", response, re.DOTALL) is not None)
    answer = _last_boxed(response)
    accuracy = float(answer is not None and _math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}


def r1v_reward(inp: RewardInput, format_weight: float = 0.5) -> dict[str, float]:
    """R1-V's reward: <think>..</think><answer>..</answer>, the answer equal to the ground truth.

    ground truth "3": "<think>count</think> <answer>3</answer>" -> overall 1.0; "<answer>3</answer>"
    -> format 0, accuracy 1, overall 0.5. Without an <answer> tag the whole response is graded (as
    EasyR1).
    """
    response = inp["response"].strip()
    format_ok = float(
        re.fullmatch(r"<think>.*?</think>\s*<answer>.*?</answer>", response, re.DOTALL) is not None)
    tagged = re.search(r"<answer>(.*?)</answer>", response, re.DOTALL)
    answer = tagged.group(1).strip() if tagged else response
    accuracy = float(answer == str(inp["ground_truth"]).strip()
                     or _math_equal(answer, inp["ground_truth"]))
    overall = (1 - format_weight) * accuracy + format_weight * format_ok
    return {"overall": overall, "format": format_ok, "accuracy": accuracy}


def toy_tools_reward(inp: RewardInput) -> dict[str, float]:
    """The built-in tool task's reward (data.toy_tool_rows): look the answer up (called), then
    answer with the digit the tool returned (accuracy, which needs the call: a guess scores
    nothing). overall = 0.2 called + 0.8 accuracy.

    ground truth "7": turns "?", tool "7", "7" -> 1.0; "?", tool "7", "3" -> 0.2;
    "7" (no call) -> 0.0.
    """
    called = float(any(m["role"] == "tool" for m in inp["messages"]))
    accuracy = called * float(inp["response"].strip().startswith(str(inp["ground_truth"])))
    return {"overall": 0.2 * called + 0.8 * accuracy, "called": called, "accuracy": accuracy}


def env_reward(inp: RewardInput) -> dict[str, float]:
    """`--reward.function env`: the score the episode's environment kept, its `get_reward()` if it
    has one, else its `reward` attribute (TRL's environments keep it so); an episode whose
    environment failed (an error counted in its record) scores 0 if it kept none. The environment
    that keeps no score at all is the run's error, named.

    an environment whose respond set self.reward = 0.75 -> {"overall": 0.75}
    """
    env = inp["env"]
    if env is None:
        raise RewardError("--reward.function env reads the episode's environment, and this sample "
                          "has none: set --rollout.env")
    getter = getattr(env, "get_reward", None)
    value = getter() if callable(getter) else getattr(env, "reward", None)
    if value is None and inp["episode"].errors:
        value = 0.0
    if value is None:
        raise RewardError(f"--reward.function env: the environment {type(env).__name__} keeps no "
                          "score (neither get_reward() nor a `reward` attribute): give it one, or "
                          "score the episode with another --reward.function")
    return {"overall": float(value)}


def no_reward(inp: RewardInput) -> dict[str, float]:
    """`--reward.function none`: every sample 0, so that the reward model's score is the whole
    reward."""
    return {"overall": 0.0}


# --------------------------------------------------------------------------------------------------
# Code run against tests, in a sandbox (plumbing/sandbox.py)
# --------------------------------------------------------------------------------------------------

def extract_code(response: str) -> str:
    """The program in a response: its last ```python (or bare ```) block, else the whole response.

    "Here:\n```python\nprint(1)\n```" -> "print(1)\n"
    """
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", response, re.DOTALL)
    return blocks[-1] if blocks else response


async def code_reward(inp: RewardInput, seconds: float = 5.0, memory_mib: int = 512,
                      allow_weaker_sandbox: bool = False) -> dict[str, float]:
    """The response's program run in the sandbox against the ground truth's tests:
    `{"tests": [{"input": ..., "output": ...}, ...]}` (stdin to stdout; lines compared without
    trailing spaces) or `{"asserts": [...]}` (Python statements run after the program, in one run),
    or that as a JSON string. overall = the share of tests passed, accuracy = all of them. A test
    that runs past `seconds`, needs more than `memory_mib` MiB, writes outside its folder, opens a
    socket or starts a process fails (plumbing/sandbox.py says how each is stopped).

    tests [{"input": "2 3", "output": "5"}]: "print(sum(map(int, input().split())))" -> overall 1.0;
    "print(6)" -> 0.0; "while True: pass" -> 0.0 (after 5 s).
    """
    truth = (json.loads(inp["ground_truth"]) if isinstance(inp["ground_truth"], str)
             else inp["ground_truth"])
    program, limits = extract_code(inp["response"]), Limits(seconds=seconds, memory_mib=memory_mib)
    if "asserts" in truth:
        outcome = await run_code(program + "\n\n" + "\n".join(truth["asserts"]) + "\n", "", limits)
        passed = [outcome.status == "ok" and outcome.returncode == 0]
    else:
        outcomes = [await run_code(program, test["input"], limits) for test in truth["tests"]]
        passed = [o.status == "ok" and o.returncode == 0
                  and _lines(o.stdout) == _lines(test["output"])
                  for o, test in zip(outcomes, truth["tests"])]
    share = sum(passed) / max(len(passed), 1)
    return {"overall": share, "accuracy": float(share == 1.0)}


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _check_sandbox(allow_weaker_sandbox: bool = False, **limits) -> None:
    """At start-up: the sandbox's protections hold on this machine, or the run is refused, naming
    the missing ones."""
    if not isinstance(allow_weaker_sandbox, bool):
        raise RewardError(f"--reward.kwargs allow_weaker_sandbox {allow_weaker_sandbox!r}: "
                          "give true or false")
    missing = [name for name, held in protections().items() if not held]
    if missing and not allow_weaker_sandbox:
        raise RewardError(f"the code reward's sandbox cannot enforce {', '.join(missing)} on this "
                          "machine (namespaces need root or unprivileged user namespaces, Landlock "
                          "Linux 5.13+); run elsewhere, or accept the weaker sandbox with "
                          "--reward.kwargs allow_weaker_sandbox true")


code_reward.check = _check_sandbox


# --------------------------------------------------------------------------------------------------
# A reasoning-gym task's own verifier (rows of --data.train-files reasoning_gym:NAME, data.py)
# --------------------------------------------------------------------------------------------------

def reasoning_gym_reward(inp: RewardInput, format_weight: float = 0.0) -> dict[str, float]:
    """reasoning-gym's reward: the answer in the response's last <answer>...</answer>
    (reasoning_gym.utils's extract_answer, as reasoning-gym's own trainer reads it), scored by the
    row's task with its own verifier (its score_answer) against the entry the row was made from
    (data.reasoning_gym_entry, metadata and all): 1 right, 0 wrong, between for the partial credit
    some tasks give. A response without the tags is handed to the verifier as no answer (None), as
    reasoning-gym's trainer does: 0 for nearly every task (countdown, fraction_simplification and
    puzzle24 give 0.01).

    accuracy: that score; tagged: the response has the tags; format: reasoning-gym's format reward,
    one <think>...</think> then one <answer>...</answer> and nothing nested; overall = accuracy +
    format_weight x format (added, as reasoning-gym's runs do, with 0.2).
    leg_counting, answer "500": "<think>add</think><answer>500</answer>" -> accuracy 1, format 1,
    overall 1.0 (1.2 with format_weight 0.2); "<answer>500 legs</answer>" -> accuracy 0.375 (3/8:
    the answer inside a longer one), format 0; "500" -> 0.0, tagged 0.
    """
    from reasoning_gym.utils import extract_answer

    row = inp["row"]
    source = row.get("reasoning_gym")
    if not isinstance(source, Mapping):
        raise RewardError("--reward.function reasoning_gym scores rows of --data.train-files "
                          "reasoning_gym:NAME, and this row has no 'reasoning_gym' column "
                          f"(its columns: {sorted(row)})")
    missing = sorted({"dataset", "seed", "size", "index"} - set(source))
    if missing:
        raise RewardError(f"--reward.function reasoning_gym: the row's 'reasoning_gym' column "
                          f"{dict(source)} lacks {missing}, from which the task's entry is "
                          "generated again")
    entry = reasoning_gym_entry(source["dataset"], source["seed"], source["size"], source["index"])
    if entry["question"] != row.get("problem"):
        raise RewardError(f"reasoning-gym task {source['dataset']!r} makes row {source['index']} "
                          f"(seed {source['seed']}, size {source['size']}) again as another "
                          "question than the row's 'problem', so the answer cannot be checked: its "
                          "generator is not deterministic (reasoning-gym 0.1.25's list_functions "
                          "draws from Python's global random; choose another task), or the row was "
                          "made in another process (set PYTHONHASHSEED: README, Data)")
    answer = extract_answer(inp["response"])
    accuracy = float(reasoning_gym_task(source["dataset"], source["seed"], source["size"])
                     .score_answer(answer, entry))
    format_ok = _think_then_answer(inp["response"])
    return {"overall": accuracy + format_weight * format_ok, "accuracy": accuracy,
            "format": format_ok, "tagged": float(answer is not None)}


def _think_then_answer(response: str) -> float:
    """reasoning-gym's format reward: 1.0 for one <think>...</think> then one <answer>...</answer>
    (after optional spaces; anything may follow), neither inside the other; else 0.0."""
    thoughts = re.findall(r"<think>(.*?)</think>", response, re.DOTALL)
    answers = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    nested = any(tag in part for part in thoughts + answers for tag in ("<think>", "<answer>"))
    laid_out = (re.match(r"\s*<think>.*?</think>\s*<answer>.*?</answer>", response, re.DOTALL)
                is not None)
    return float(laid_out and len(thoughts) == len(answers) == 1 and not nested)


def _check_reasoning_gym(format_weight: float = 0.0) -> None:
    """At start-up: reasoning-gym, whose verifiers score the answers, is installed."""
    try:
        # imported here only: its import takes a second or more
        import reasoning_gym.utils  # noqa: F401
    except ImportError:
        raise RewardError("--reward.function reasoning_gym needs reasoning-gym: "
                          "pip install reasoning-gym") from None


reasoning_gym_reward.check = _check_reasoning_gym


# --------------------------------------------------------------------------------------------------
# An LLM judge over HTTP
# --------------------------------------------------------------------------------------------------

class Judge:
    """The built-in `judge` reward: a model served at an OpenAI-compatible endpoint (`vllm serve`,
    an API) grades each response (plumbing/judge.py asks it: once a prompt, retried, the endpoint
    found at start-up). Its prompt is --reward.judge-template rendered with the prompt, the
    response, the ground truth and the row; its score the last match of --reward.judge-parser in the
    reply (or what a parser function returns). The requests go out at once (at most
    --reward.max-concurrency). A reply that is no chat completion or holds no score, and a parser
    function that raises, are the sample's failure (--reward.on-error), named with the start of the
    reply.
    """

    def __init__(self, config: RewardConfig):
        if not config.judge_url:
            raise RewardError("--reward.function judge needs --reward.judge-url, the "
                              "OpenAI-compatible endpoint of the judge model (e.g. "
                              "http://127.0.0.1:8000/v1 for `vllm serve MODEL --port 8000`)")
        self.template = load_template(config.judge_template, "--reward.judge-template")
        parse = (_parser_function(config.judge_parser)
                 if config.judge_parser.endswith(".py") or ".py:" in config.judge_parser
                 else _last_number(config.judge_parser))
        try:
            request = json.loads(config.judge_request) if config.judge_request else {}
        except json.JSONDecodeError as error:
            raise RewardError(f"--reward.judge-request {config.judge_request!r} is not JSON: "
                              f"{error}") from None
        try:
            self.client = JudgeClient(config.judge_url, config.judge_model, config.judge_timeout,
                                      config.judge_retries, request, parse)
        except JudgeError as error:
            raise RewardError(str(error)) from None

    async def __call__(self, inp: RewardInput) -> dict[str, float]:
        prompt = self.template.render(prompt=inp["prompt"], response=inp["response"],
                                      ground_truth=inp["ground_truth"], row=inp["row"])
        try:
            return await self.client(prompt)
        except JudgeError as error:
            raise RewardError(str(error)) from None


def _last_number(pattern: str) -> Callable[[str], dict[str, float]]:
    """A parser: the last match of `pattern` in the reply is the score; no match raises, naming the
    reply."""
    regex = re.compile(pattern)

    def parse(text: str) -> dict[str, float]:
        matches = regex.findall(text)
        if not matches:
            raise RewardError(f"the judge's reply {text!r:.80} holds no score "
                              f"(--reward.judge-parser {pattern!r})")
        return {"overall": float(matches[-1] if isinstance(matches[-1], str) else matches[-1][0])}

    return parse


def _parser_function(spec: str) -> Callable[[str], dict[str, float]]:
    """A parser: path/to/file.py:function, reply text -> a float, or a dict of scores with overall.
    A failure (what it raises, a result that is no number) names the parser and the reply it failed
    on."""
    fn = load_reward(spec)

    def parse(text: str) -> dict[str, float]:
        try:
            score = fn(text)
            return dict(score) if isinstance(score, Mapping) else {"overall": float(score)}
        except Exception as error:
            raise RewardError(f"--reward.judge-parser {spec!r} raised {error!r} "
                              f"(the judge's reply: {text!r:.80})") from error

    return parse


# --------------------------------------------------------------------------------------------------
# TRL's reward functions, run unchanged
# --------------------------------------------------------------------------------------------------

# what TRL's GRPOTrainer passes a reward function by these names, beside the dataset's columns
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "environments")


@dataclass
class TrainerState:
    """What a TRL reward function reads of the run as `trainer_state`, named as transformers'
    TrainerState: the optimizer steps done before the scored samples' step, and all of them
    (--trainer.total-steps). None until the trainer sets them."""

    global_step: int | None = None
    max_steps: int | None = None


def is_trl_reward(fn: Callable) -> bool:
    """TRL's kind of reward function: one that takes a parameter named `completions`
    (`def reward(completions, **kwargs)`, `def accuracy(completions, solution, **kwargs)`); this
    project's own take one sample (or one list of them) under any other name."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: this project's kind
        return False


class TRLReward:
    """A reward function of TRL's GRPOTrainer, run unchanged as a batch reward:
    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., [environments=...],
    **columns, **--reward.kwargs) -> one float (or None) a sample, as TRL calls it.

    - completions: the response texts; for a conversational dataset (the row's `prompt` column a
      list of messages, TRL's rule) or a multi-turn episode, each sample's messages after the
      prompt, `[{"role": "assistant", "content": ...}]` for one turn (after a prompt that ends with
      the assistant's message, that message's text opens it, as TRL's prefill);
    - prompts: the row's `prompt` column as written (TRL's column name), else the chat-formatted
      prompt; completion_ids: the response's token ids; trainer_state: TrainerState;
    - every other column of the row by its name, one value a sample (not `prompt`, `completion` or
      `completion_ids`, as TRL); --reward.kwargs as they are;
    - environments: the episodes' environment objects (--rollout.env), one a sample, when the
      samples have them.
    A function without **kwargs gets only the names it takes. Its result: a float a sample, or None
    (TRL: this function does not score the sample) -> overall 0, as TRL's sum over its functions
    gives with one function, and `unscored` 1 (0 for a scored sample), logged as the share.

    completions ["7", "8"], ground truth "7", fn returning [1.0, None]
    -> [{"overall": 1.0, "unscored": 0.0}, {"overall": 0.0, "unscored": 1.0}]
    """

    def __init__(self, fn: Callable, name: str, trainer_state: TrainerState):
        self.fn, self.name, self.trainer_state = fn, name, trainer_state
        parameters = inspect.signature(fn).parameters.values()
        self.takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self.names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        self.required = [p.name for p in parameters if p.default is p.empty
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def check(self, **kwargs) -> None:
        """At start-up: --reward.kwargs neither take TRL's own names nor names it does not take."""
        reserved = sorted(set(kwargs) & set(TRL_ARGUMENTS))
        unknown = [] if self.takes_any else sorted(set(kwargs) - self.names)
        if reserved or unknown:
            raise RewardError(f"TRL reward {self.name!r}: --reward.kwargs {reserved or unknown} " +
                              ("are TRL's own arguments, filled by the trainer" if reserved
                               else f"are not among its parameters {sorted(self.names)}"))

    def arguments(self, inputs: list[RewardInput], kwargs: dict) -> dict:
        rows = [inp["row"] for inp in inputs]
        conversational = _is_conversation(rows[0].get("prompt"))
        arguments = {
            **{key: [row.get(key) for row in rows] for key in rows[0]
               if key not in ("prompt", "completion", "completion_ids")},
            **kwargs,
            "prompts": [row.get("prompt", inp["prompt"]) for row, inp in zip(rows, inputs)],
            "completions": [_completion(inp) if conversational or inp["episode"] is not None
                            else inp["response"] for inp in inputs],
            "completion_ids": [inp["response_ids"] for inp in inputs],
            "trainer_state": self.trainer_state}
        if any(inp["env"] is not None for inp in inputs):
            arguments["environments"] = [inp["env"] for inp in inputs]
        if not self.takes_any:
            arguments = {key: value for key, value in arguments.items() if key in self.names}
        missing = [name for name in self.required if name not in arguments]
        if missing:
            raise RewardError(f"TRL reward {self.name!r} takes {missing}, neither a column of the "
                              f"dataset (its columns: {sorted(rows[0])}) nor one of TRL's "
                              f"arguments {list(TRL_ARGUMENTS)}: give it a default, or add the "
                              "column")
        return arguments

    @staticmethod
    def scores(results, count: int):
        """The function's floats as score dicts; anything else as it came, for RewardFunction to
        name."""
        values = results.tolist() if hasattr(results, "tolist") else results  # numpy, torch
        if not isinstance(values, (list, tuple)) or len(values) != count:
            return results
        return [{"overall": 0.0, "unscored": 1.0} if value is None
                else {"overall": value, "unscored": 0.0} for value in values]

    def __call__(self, inputs: list[RewardInput], **kwargs) -> list[dict[str, float]]:
        return self.scores(self.fn(**self.arguments(inputs, kwargs)), len(inputs))


class AsyncTRLReward(TRLReward):
    """A TRL reward function that is an `async def` (TRL awaits them too)."""

    async def __call__(self, inputs: list[RewardInput], **kwargs) -> list[dict[str, float]]:
        return self.scores(await self.fn(**self.arguments(inputs, kwargs)), len(inputs))


def _is_conversation(prompt) -> bool:
    """TRL's is_conversational for a prompt: a list of {"role", "content"} messages."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and isinstance(prompt[0], Mapping) and "role" in prompt[0])


def _completion(inp: RewardInput) -> list[dict]:
    """A sample's messages after the prompt, as TRL gives a conversational completion; after a
    prompt that ends with the assistant's message (a prefill), that text opens the first."""
    messages = [dict(message) for message in inp["messages"]]
    prompt = inp["row"].get("prompt")
    last = prompt[-1] if _is_conversation(prompt) else {}
    if last.get("role") == "assistant" and isinstance(last.get("content"), str) and messages:
        messages[0]["content"] = last["content"] + messages[0]["content"]
    return messages


BUILTINS: dict[str, Callable] = {"toy": toy_reward, "math": math_reward, "r1v": r1v_reward,
                                  "toy_tools": toy_tools_reward, "code": code_reward,
                                  "reasoning_gym": reasoning_gym_reward, "judge": Judge,
                                  "env": env_reward, "none": no_reward}


def combine(scores: list[dict[str, float]], weights: dict[str, float]) -> list[dict[str, float]]:
    """overall = the sum of weight x score over `weights`' keys; the function's own overall is kept
    as `function`.

    {"overall": 1.0, "model": 0.4} with weights {"overall": 1, "model": 0.5}
    -> overall 1.2, function 1.0.
    """
    if not weights:
        return scores
    missing = sorted(set(weights) - set(scores[0])) if scores else []
    if missing:
        raise RewardError(f"--reward.weights names {missing}, which the scores do not hold "
                          f"(they hold {sorted(scores[0])}); a reward model's key is `model`")
    return [{**s, "function": s["overall"], "overall": sum(w * s[k] for k, w in weights.items())}
            for s in scores]


def reward_inputs(tokenizer, items: list, responses: list[list]) -> list[RewardInput]:
    """What the reward function gets for each response of each prompt (dataset items,
    rollout.Response lists). A multi-turn episode's reward reads its turns (`messages`), its record
    and its environment, and, as `response`, its last generated turn's text (without the tool calls
    it made)."""
    inputs = []
    for item, group in zip(items, responses):
        for r in group:
            messages = r.episode.messages if r.episode else [
                {"role": "assistant",
                 "content": tokenizer.decode(r.token_ids, skip_special_tokens=True)}]
            last = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
            inputs.append(RewardInput(response=last, response_length=len(r.token_ids),
                                      response_ids=list(r.token_ids),
                                      ground_truth=item["ground_truth"], prompt=item["prompt"],
                                      row=item["row"], images=item["images"],
                                      videos=item["videos"], messages=messages, episode=r.episode,
                                      env=r.episode.environment if r.episode else None))
    return inputs

_GRADING_TIMEOUT_S = 5  # per parse / per comparison; math_verify's alarm takes whole seconds


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, nested braces included:
    "a \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin, depth = start + len("\\boxed{"), 0
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # never closed: the response was cut off


def _math_equal(answer: str, ground_truth: Any) -> bool:
    """True if both denote the same mathematical object: "0.5", "1/2" and "\\frac{1}{2}" are all
    equal."""
    # math_verify's timeouts use signal.alarm, which only works in a process's main thread (as in
    # each torchrun worker); in any other thread it raises, so there we grade without a time limit,
    # and an answer like "99999999999!" can then hang sympy.
    timeout = _GRADING_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${ground_truth}$", parsing_timeout=timeout)
        predicted = parse(f"${answer}$", parsing_timeout=timeout)
        return verify(gold, predicted, timeout_seconds=timeout)
    # TimeoutException derives from BaseException, not Exception
    except (Exception, TimeoutException):
        # math_verify already turns its own errors and timeouts into []/False; this guard is for an
        # alarm that fires between its try blocks: one odd answer is wrong, not a reason to stop
        # training.
        return False


def overlong_penalty(response_length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then linearly down
    to -1.

    max_length 20, buffer 4: 16 tokens -> 0.0; 18 -> -0.5; 20 -> -1.0.
    """
    expected = max_length - buffer
    return max(min((expected - response_length) / buffer, 0.0), -1.0)


# --------------------------------------------------------------------------------------------------
# Loading and calling the configured reward
# --------------------------------------------------------------------------------------------------

@dataclass
class Group:
    """The rollout of one prompt: its dataset item, its n responses, their reward dicts (empty until
    scored), and (ReMax) the score of its greedy response."""

    item: dict  # data.PromptItem
    responses: list  # rollout.Response
    scores: list[dict[str, float]] = field(default_factory=list)
    baseline: float | None = None


@dataclass
class Scoring:
    """What scores a step's responses: the reward function (any kind) and, with a reward model, its
    score of every sequence (`model`: groups, their trainer batch or None -> a score a response;
    logprobs.reward_model_scores), combined by --reward.weights."""

    reward_fn: "RewardFunction"
    tokenizer: Any
    model: Callable[[list, Any], list[float]] | None = None
    weights: dict[str, float] = field(default_factory=dict)

    def start(self, items: list, responses: list[list], step: int | None = None
              ) -> tuple[list[Group], "RoundScores"]:
        """Each prompt's group, unscored, and the round's scores, the reward function's call on all
        of them started (an async reward runs while the caller goes on). `step`: the training steps
        done (a TRL reward function's trainer_state.global_step; validation leaves it as it is)."""
        if step is not None:
            self.reward_fn.trainer_state.global_step = step
        return ([Group(item, group) for item, group in zip(items, responses)],
                RoundScores(self, self.reward_fn.submit(
                    reward_inputs(self.tokenizer, items, responses))))

    def model_scores(self, groups: list[Group], batch=None) -> None:
        """With a reward model: its score of every sequence (key `model`; `batch`: the groups'
        trainer batch, built for it when not given) and the weighted overall (combine); nothing
        without one."""
        if self.model is None:
            return
        model = iter(self.model(groups, batch))
        for group in groups:
            group.scores = combine([{**s, "model": next(model)} for s in group.scores],
                                   self.weights or {"overall": 1.0, "model": 1.0})

    def __call__(self, items: list, responses: list[list]) -> list[Group]:
        """Every score of a round at once: the function's, then the model's."""
        groups, scores = self.start(items, responses)
        scores.give(groups)
        return groups


@dataclass
class RoundScores:
    """A round's scores, given to its groups as they come: the reward function's (an async reward
    may still be running), then, once, the reward model's (Scoring.model_scores)."""

    scoring: Scoring
    pending: "PendingScores | None"  # the function's, not yet given (None: given)
    modelled: bool = False  # the reward model's given

    def function_scores(self, groups: list[Group]) -> None:
        """The reward function's scores into the groups, n each, if they are not there yet (dynamic
        sampling filters on them before the model scores)."""
        if self.pending is not None:
            scores = iter(self.pending.result())
            for group in groups:
                group.scores = [next(scores) for _ in group.responses]
            self.pending = None

    def give(self, groups: list[Group], batch=None) -> None:
        """Every score not yet given: the function's, then the reward model's (`batch`: the groups'
        trainer batch, built for it when not given)."""
        self.function_scores(groups)
        if not self.modelled:
            self.scoring.model_scores(groups, batch)
            self.modelled = True


def read_flag(value):
    """A --reward.kwargs value with `true` and `false` (any case) as booleans: on the command line
    they arrive as strings, and the string "false" is true to Python (`allow_weaker_sandbox false`
    would weaken the sandbox)."""
    return ({"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str)
            else value)


class RewardFunction:
    """The configured reward, called on a list of samples; every call is timed and every result
    checked.

    RewardFunction(RewardConfig("toy"))([{"response": "7", "ground_truth": "7", ...}])
    -> [{"overall": 1.0, "accuracy": 1.0, "concise": 1.0}]

    Four kinds, told apart by the function itself: per sample or a whole batch (--reward.batch),
    each plain or an `async def`. A plain call runs on the calling thread, where the time limit can
    interrupt it (Deadline); async calls run at once (at most --reward.max-concurrency) on an event
    loop of this reward's own thread, each within the time limit, while the caller goes on
    (`submit`: the trainer's reference pass, say) until it asks for the scores, and a call that
    never yields (a blocking sleep inside `async def`) is given up when the limit has passed for all
    of them. A call that fails (runs past --reward.timeout, raises, exits, returns something that is
    not a dict of finite numbers with `overall`) ends the run with a RewardError naming the reward
    and the sample (--reward.on-error raise), or scores its samples 0 on every key, reported once
    through `report` and counted in the `failed` key every result then carries (zero; skip-group,
    whose caller then drops the sample's group).
    """

    def __init__(self, config: RewardConfig, max_response_length: int = 0,
                 report: Callable[[str], None] = print):
        self.config, self.max_response_length, self.report = config, max_response_length, report
        if config.overlong_buffer and not 0 < config.overlong_buffer < max_response_length:
            raise RewardError(f"--reward.overlong-buffer {config.overlong_buffer} must be between "
                              f"0 and --rollout.max-response-length {max_response_length}")
        if config.timeout < 0:
            raise RewardError(f"--reward.timeout {config.timeout} must be at least 0 (0: no limit)")
        if config.max_concurrency < 1:
            raise RewardError(f"--reward.max-concurrency {config.max_concurrency} "
                              "must be at least 1")
        self.name = config.function  # the spec string, for logs and error messages
        self.kwargs = {key: read_flag(value) for key, value in config.kwargs.items()}
        self.batch = config.batch
        if self.name in BUILTINS and self.batch:
            raise RewardError(f"built-in reward {self.name!r} is per-sample: drop --reward.batch")
        self.fn = BUILTINS[self.name] if self.name in BUILTINS else load_reward(self.name)
        if self.fn is Judge:  # the judge keeps a client and its replies: an instance is the reward
            self.fn = Judge(config)
        # what a TRL reward function reads as `trainer_state`; the trainer sets it each step
        self.trainer_state = TrainerState()
        if self.name not in BUILTINS and is_trl_reward(self.fn):  # TRL's kind: a batch reward
            kind = AsyncTRLReward if _is_async(self.fn) else TRLReward
            self.fn, self.batch = kind(self.fn, self.name, self.trainer_state), True
        try:
            inspect.signature(self.fn).bind(None, **self.kwargs)
        except TypeError as exc:
            raise RewardError(f"reward {self.name!r} does not take --reward.kwargs {self.kwargs}: "
                              f"{exc}") from exc
        # a built-in's start-up check (code's sandbox)
        getattr(self.fn, "check", lambda **kwargs: None)(**self.kwargs)
        self.is_async = _is_async(self.fn)
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.deadline = (Deadline() if config.timeout and not self.is_async and on_main_thread
                         else None)
        self.loop = EventLoop(config.max_concurrency, config.timeout)  # an async reward's calls
        self.keys: list[str] = []  # of the results so far: what a failed sample is scored 0 on

    def __call__(self, inputs: list[RewardInput]) -> list[dict[str, float]]:
        return self.submit(inputs).result()

    def submit(self, inputs: list[RewardInput]) -> "PendingScores":
        """Start scoring `inputs`: a plain reward scores them now; an async one's calls start on its
        event loop and the caller may do other work before `result()`."""
        if not inputs:  # a rank without prompts (a validation set smaller than the world)
            return PendingScores(self, inputs, [])
        arguments = [inputs] if self.batch else inputs
        if not self.is_async:
            where = [f"on a batch of {len(inputs)} samples"] if self.batch else [""] * len(inputs)
            return PendingScores(self, inputs,
                                 [self._call(arg, i, inputs[i], w)
                                  for i, (arg, w) in enumerate(zip(arguments, where))])
        return PendingScores(self, inputs,
                             [self.loop.submit(self.fn, arg, **self.kwargs) for arg in arguments])

    def _finish(self, inputs: list[RewardInput], results: list) -> list[dict[str, float]]:
        """The checked scores of `inputs` from the calls' `results` (one per sample, or one list for
        the batch)."""
        if self.batch:
            results = results[0]
            if not isinstance(results, RewardError) and (not isinstance(results, (list, tuple))
                                                         or len(results) != len(inputs)):
                got = (f"{len(results)} results" if isinstance(results, (list, tuple))
                       else repr(results)[:80])
                results = self._failed(0, inputs[0], f"returned {got}",
                                       f"for {len(inputs)} samples")
            if isinstance(results, RewardError):
                results = [results] * len(inputs)
        scores = [self._check(i, inp, result)
                  for i, (inp, result) in enumerate(zip(inputs, results))]
        for i, (inp, score) in enumerate(zip(inputs, scores)):
            if isinstance(score, dict) and self.keys and sorted(score) != self.keys:
                scores[i] = self._failed(i, inp, f"returned keys {sorted(score)}, "
                                         f"earlier samples {self.keys}")
            elif isinstance(score, dict):
                self.keys = sorted(score)
        # the share of failed samples, logged as the mean of this key
        if self.config.on_error != "raise":
            scores = [{**self._zeros(), "failed": 1.0} if isinstance(score, RewardError)
                      else {**score, "failed": 0.0}
                      for score in scores]
        if self.config.overlong_buffer:  # DAPO: added to the reward, and logged on its own
            for inp, score in zip(inputs, scores):
                penalty = self.config.overlong_penalty_factor * overlong_penalty(
                    inp["response_length"], self.max_response_length, self.config.overlong_buffer)
                score["overall"] += penalty
                score["overlong_penalty"] = penalty
        # a model's: once it has scored
        return scores if self.config.model else combine(scores, self.config.weights)

    def _call(self, argument, index: int, inp: RewardInput, where: str = ""):
        """fn(argument, **kwargs) within the time limit, or the failure as a RewardError (returned,
        not raised)."""
        try:
            with self.deadline(self.config.timeout) if self.deadline else nullcontext():
                return self.fn(argument, **self.kwargs)
        except CallTimeout:
            return self._failed(index, inp, f"ran past --reward.timeout {self.config.timeout:g}s",
                                where)
        # KeyboardInterrupt aside: a Ctrl-C stops the run
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            return self._raised(index, inp, exc, where)

    def _raised(self, index: int, inp: RewardInput, exc: BaseException,
                where: str = "") -> RewardError:
        if isinstance(exc, (CallTimeout, TimeoutError)):
            return self._failed(index, inp, f"ran past --reward.timeout {self.config.timeout:g}s",
                                where)
        if isinstance(exc, SystemExit):
            return self._failed(index, inp, f"called sys.exit({exc.code!r})", where)
        if isinstance(exc, RewardError):  # a failure the reward names itself (the judge's)
            return self._failed(index, inp, f"failed: {exc}", where, exc)
        return self._failed(index, inp, f"raised {exc!r}", where, exc)

    def _check(self, index: int, inp: RewardInput, result: Any) -> dict[str, float] | RewardError:
        if isinstance(result, RewardError):
            return result
        if not isinstance(result, Mapping) or "overall" not in result:
            return self._failed(index, inp, f"returned {result!r:.80}, "
                                "expected a dict with an 'overall' key" +
                                (" (a TRL reward function, which returns a float a sample, takes "
                                 "a parameter named `completions`)" if isinstance(result, Real)
                                 else ""))
        for key, value in result.items():
            if not isinstance(value, Real) or not isfinite(value):
                return self._failed(index, inp, f"returned {key}={value!r:.80}, "
                                    "expected a finite number")
            if abs(value) > FLOAT32_MAX:
                return self._failed(index, inp, f"returned {key}={value!r:.80}, beyond float32's "
                                    "range, in which the trainer computes advantages")
        return {key: float(value) for key, value in result.items()}

    def _failed(self, index: int, inp: RewardInput, problem: str, where: str = "",
                cause=None) -> RewardError:
        """The failure of sample `index`: raised (--reward.on-error raise) or returned, reported the
        first time."""
        error = RewardError(f"reward {self.name!r} {problem} {where or f'on sample {index}'} "
                            f"(response={inp['response']!r:.80}, "
                            f"ground_truth={inp['ground_truth']!r:.80})")
        if self.config.on_error == "raise":
            raise error from cause
        then = "scored 0" if self.config.on_error == "zero" else "its group left out of the step"
        self.report(f"warning: {error}; {then} (--reward.on-error {self.config.on_error}), "
                    "counted in the reward's `failed` key from now on without a message")
        self.report = lambda message: None
        return error

    def _zeros(self) -> dict[str, float]:
        return dict.fromkeys(self.keys or ["overall"], 0.0)


FLOAT32_MAX = 3.4028234663852886e38


def _is_async(fn: Callable) -> bool:
    """An `async def` function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


class PendingScores:
    """The scores of samples that may still be coming (RewardFunction.submit): `result()` waits for
    the calls, at most until each of them has had its time limit after the last could start, and
    checks what they returned."""

    def __init__(self, reward: RewardFunction, inputs: list[RewardInput], calls: list):
        self.reward, self.inputs, self.calls, self.started = reward, inputs, calls, time.monotonic()

    def result(self) -> list[dict[str, float]]:
        reward, results = self.reward, list(self.calls)
        if reward.is_async:
            where = f"on a batch of {len(self.inputs)} samples" if reward.batch else ""
            for k, outcome in enumerate(reward.loop.results(self.calls, self.started)):
                index = 0 if reward.batch else k
                results[k] = (reward._raised(index, self.inputs[index], outcome.exception, where)
                              if isinstance(outcome, Raised) else outcome)
        return reward._finish(self.inputs, results)


def load_reward(spec: str) -> Callable[..., Any]:
    """`path/to/file.py:function` (or `module:function`) -> the function (plumbing/loading.py)."""
    if ":" not in spec:
        raise RewardError(f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTINS)}) or "
                          "path/to/file.py:function")
    try:
        fn = load_object(spec, "reward", "--reward.function")
    except ValueError as error:
        raise RewardError(str(error)) from None
    if not callable(fn):
        raise RewardError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn
