"""TRL's reward functions run unchanged (rewards.py's RewardFunction wraps one it is given): the arguments TRL's
GRPOTrainer passes them, made from this project's reward inputs, and their floats (or None) made score dicts. A
failure is raised as the `error` class the caller gives (rewards.RewardError)."""

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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

    def __init__(self, fn: Callable, name: str, trainer_state: TrainerState, error: type[Exception]):
        self.fn, self.name, self.trainer_state, self.error = fn, name, trainer_state, error
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
            raise self.error(f"TRL reward {self.name!r}: --reward.kwargs {reserved or unknown} " +
                              ("are TRL's own arguments, filled by the trainer" if reserved
                               else f"are not among its parameters {sorted(self.names)}"))

    def arguments(self, inputs: list[dict], kwargs: dict) -> dict:
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
            raise self.error(f"TRL reward {self.name!r} takes {missing}, neither a column of the "
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

    def __call__(self, inputs: list[dict], **kwargs) -> list[dict[str, float]]:
        return self.scores(self.fn(**self.arguments(inputs, kwargs)), len(inputs))


class AsyncTRLReward(TRLReward):
    """A TRL reward function that is an `async def` (TRL awaits them too)."""

    async def __call__(self, inputs: list[dict], **kwargs) -> list[dict[str, float]]:
        return self.scores(await self.fn(**self.arguments(inputs, kwargs)), len(inputs))


def _is_conversation(prompt) -> bool:
    """TRL's is_conversational for a prompt: a list of {"role", "content"} messages."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and isinstance(prompt[0], Mapping) and "role" in prompt[0])


def _completion(inp: dict) -> list[dict]:
    """A sample's messages after the prompt, as TRL gives a conversational completion; after a
    prompt that ends with the assistant's message (a prefill), that text opens the first."""
    messages = [dict(message) for message in inp["messages"]]
    prompt = inp["row"].get("prompt")
    last = prompt[-1] if _is_conversation(prompt) else {}
    if last.get("role") == "assistant" and isinstance(last.get("content"), str) and messages:
        messages[0]["content"] = last["content"] + messages[0]["content"]
    return messages
