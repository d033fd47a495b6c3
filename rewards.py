"""Rewards: turn decoded responses into scores,
`{"overall": float, <sub-score>: float, ...}` per sample.

Design decisions:
- A reward is a plain function: a built-in task's, the `reward` of tasks/NAME.py (toy, math, r1v,
  toy_tools, code, reasoning_gym), one that is no task's (judge, env, none: builtin_reward), or a
  user's `path/to/file.py:function`. Per-sample kind:
  fn(RewardInput, **kwargs) -> dict; batch kind (`--reward.batch`, e.g. for a reward model):
  fn(list[RewardInput], **kwargs) -> list[dict]; TRL's kind, told by a parameter named
  `completions`, run unchanged (plumbing/trl_rewards.py): fn(completions, **kwargs) ->
  list[float | None].
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
  (plumbing/calls.py), the judge and its HTTP client (plumbing/judge.py), TRL's reward functions
  (plumbing/trl_rewards.py), loading a user's file or a task's reward (plumbing/loading.py); a
  reward model is a feature (features/reward_model.py), whose pass Scoring is given.

Use: `--reward.function math --reward.kwargs format_weight 0.2`
  or `--reward.function my_rewards.py:score --reward.batch`.
"""

import inspect
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from math import isfinite
from numbers import Real
from typing import Annotated, Any, Literal, TypedDict

import tyro

from plumbing.calls import CallTimeout, Deadline, EventLoop, Raised
from plumbing.judge import Judge
from plumbing.loading import load_function, task_piece, tasks_with
from plumbing.trl_rewards import AsyncTRLReward, TrainerState, TRLReward, is_trl_reward


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
# The rewards that are no task's (the tasks' own are the `reward` of tasks/NAME.py)
# --------------------------------------------------------------------------------------------------

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


# the judge: plumbing/judge.py's Judge, made with the config
GENERIC = {"judge": Judge, "env": env_reward, "none": no_reward}


def builtin_reward(name: str) -> Callable | None:
    """The built-in reward `name`: judge, env or none, else the `reward` of tasks/NAME.py
    (plumbing/loading.py); None for any other name."""
    return GENERIC.get(name) or task_piece(name, "reward")


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
    features/reward_model.RewardModel), combined by --reward.weights."""

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
        builtin = builtin_reward(self.name)
        if builtin is not None and self.batch:
            raise RewardError(f"built-in reward {self.name!r} is per-sample: drop --reward.batch")
        self.fn = builtin if builtin is not None else load_reward(self.name)
        if self.fn is Judge:  # the judge keeps a client and its replies: an instance is the reward
            self.fn = Judge(config, RewardError)
        # what a TRL reward function reads as `trainer_state`; the trainer sets it each step
        self.trainer_state = TrainerState()
        if builtin is None and is_trl_reward(self.fn):  # TRL's kind: a batch reward
            kind = AsyncTRLReward if _is_async(self.fn) else TRLReward
            self.fn, self.batch = kind(self.fn, self.name, self.trainer_state, RewardError), True
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
        raise RewardError(f"unknown reward {spec!r}: use a built-in "
                          f"({', '.join([*tasks_with('reward'), *GENERIC])}) or "
                          "path/to/file.py:function")
    try:
        return load_function(spec, "reward", "--reward.function")
    except ValueError as error:
        raise RewardError(str(error)) from None
