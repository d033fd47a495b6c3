"""Environments: what answers the model turn after turn in a multi-turn episode (the contract, the
kinds of environment, TextArena's games); the episodes themselves are features/episodes.py's.

    # the built-in task (tasks/toy_env.py's ToyVault)
    torchrun --nproc_per_node 2 grpo.py toy_env
    # yours: one new file
    ... --rollout.env my_env.py:Game --reward.function env
    # a TextArena game (TextArenaGame)
    ... --rollout.env textarena:GuessTheNumber-v0 --data.train-files seeds

An environment is a class. Each episode gets an instance of its own, made with no arguments, and
plays it so:
    reset(**row) -> observation | None
        the episode's dataset row (the columns reset names; all of them with **kwargs); what it
        returns ends the prompt's user turn
    respond(turn: str) -> observation | None
        the answer to each generated turn (its text); None: the episode is over
or, without `respond`, TRL's `environment_factory` shape: its public methods (typed, their arguments
documented) are tools the model calls (features/tools.py), and the episode is over at a turn that
calls none; such a class runs unchanged.
    reward, or get_reward()
        what `--reward.function env` scores the episode with (rewards.py)
An observation is text, a PIL image (vision-language models) or a list of them (one turn of parts),
or, from respond, messages ({"role": ..., "content": ...} dicts).

Design decisions (the loop that plays the episodes, tokens in and out, is features/episodes.py's):
- Failures are the environment's, not the run's: a call that raises (sys.exit too; os._exit and
  os.fork raise: plumbing/calls.py), runs past its time limit, or returns something that is no
  observation, and a class that raises when made, becomes `error: ...`, which the model reads,
  counted in `episode/errors`; --rollout.max-env-errors of them end the episode, and so does a call
  that timed out (its environment is still busy with it) or a class not made. The first failed
  start and the first failed answer are said on the console, once a run, as a reward's first
  failure is; a step whose every episode failed to start is the run's error (it would train on
  nothing). An environment that never says done ends at --rollout.max-turns or the token budget.
- A respond-style environment sees every generated turn, the last one too: it keeps the score, and
  the last move can decide the game. Its answer is shown only while the episode goes on. A tool call
  in a turn that cannot be followed is not run (TRL's rule): no one would read its result.
- A built-in environment is a task's (`--rollout.env NAME`: the `environment` of tasks/NAME.py or
  tasks/NAME_env.py, found by name: environment_class), so a new one is one file and no edit.
"""

import copy
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from model.vision import image_tokens
from plumbing.calls import Call, Outcome
from plumbing.loading import load_object, task_piece, tasks_with

STOP_REASONS = ("done", "max_turns", "length", "errors")
# an answer's text is cut at this many characters per token of the episode's budget
RESULT_CHARS_PER_TOKEN = 8


@dataclass
class Episode:
    """What happened in one sampled episode: the reward function reads it (and its environment), the
    metrics count it."""

    messages: list[dict] = field(default_factory=list)
    """The turns after the prompt, as the model read them: reset's answer ({"role": "user", ...}:
    the end of the prompt's user turn), then each generated turn ({"role": "assistant", "content":
    text}, with its "tool_calls" in a tool environment) and the environment's answer to it (user or
    tool messages), in order."""
    turns: int = 0
    calls: int = 0  # the environment's calls: reset and respond, or the tool calls
    errors: int = 0  # of which failed
    seconds: float = 0.0  # spent in the environment's calls, summed (they overlap in time)
    stop_reason: str = ""  # one of STOP_REASONS
    environment: Any = None
    """The user's environment object (None for tool functions alone; Unmade where its class raised
    when made), which `--reward.function env` reads. It stays on its rank: an episode sent to
    another rank (sequence parallelism) travels without it."""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "environment": None}


@dataclass
class Reply:
    """An environment's answer to a turn, or to the start of an episode."""

    messages: list[dict] | None  # what the model reads next; None: the episode is over
    calls: int = 0
    errors: int = 0  # failed calls among them
    seconds: float = 0.0
    # a call still running past its time limit: the environment can answer nothing more
    busy: bool = False
    error: str = ""  # the first failed call's error, which the console shows once a run

    def failed(self, error: str, busy: bool = False) -> None:
        """A failed call: counted, and its error in what the model reads (`busy`: the environment
        can answer nothing more)."""
        self.errors += 1
        self.busy |= busy
        self.error = self.error or error
        if self.messages is not None:
            self.messages.append({"role": "user", "content": f"error: {error}"})


@dataclass
class Unmade:
    """The environment of an episode whose class raised (or ran past its time limit) when made: the
    episode's failure, counted. It keeps no score, so `--reward.function env` scores the episode
    0."""

    error: str


def observation_parts(value, max_chars: int, processor=None) -> list:
    """An observation as parts, text and images: text, an image, or a list of them, the text cut to
    `max_chars` characters in all (cut). Anything else raises ValueError, as does an image the model
    cannot read (check_images)."""
    parts = value if isinstance(value, list) else [value]
    if not parts or not all(isinstance(part, (str, Image.Image)) for part in parts):
        raise ValueError(f"returned {type(value).__name__} {value!r:.60}, which is no observation: "
                         "give text, an image, a list of them, or messages")
    check_images(parts, processor)
    return cut(parts, max_chars)


def check_images(parts: list, processor) -> None:
    """The images among `parts` are ones the model reads: `processor` is the model's (None: it reads
    text only), and takes their size (Qwen-VL refuses an aspect ratio of 200 or more)."""
    for image in (part for part in parts if isinstance(part, Image.Image)):
        if processor is None:
            raise ValueError("returned an image, but the model reads text only")
        try:
            image_tokens(processor, image.size)
        except ValueError as error:
            raise ValueError(f"returned an image of {image.width} x {image.height} pixels, which "
                             f"the model cannot read: {error}") from None


def observation_messages(value, max_chars: int, processor=None) -> list[dict]:
    """An observation as the messages of a turn: messages as they are ({"role", "content"} dicts,
    their content read as parts), anything else one user message of its parts
    (observation_parts); the whole answer cut to `max_chars` (cut_answer)."""
    messages = [value] if isinstance(value, dict) else value
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        return [{"role": "user",
                 "content": content(observation_parts(value, max_chars, processor))}]
    for message in messages:
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"returned the message {message!r:.60}; a message is "
                             f"{{'role': ..., 'content': ...}}")
    read = [{**m, "content": observation_parts(m["content"], max_chars, processor)}
            for m in messages]
    return [{**m, "content": content(m["content"])} for m in cut_answer(read, max_chars)]


def cut(parts: list, max_chars: int) -> list:
    """The parts with their text cut to `max_chars` characters in all (0: as they are), the cut said
    where it is: (["abcdef", "gh"], 4) -> ["abcd [... 4 more characters]"]."""
    total = sum(len(part) for part in parts if isinstance(part, str))
    if not max_chars or total <= max_chars:
        return parts
    kept, left = [], max_chars
    for part in parts:
        if isinstance(part, str):
            if left == 0:
                continue
            part, left = part[:left], left - min(left, len(part))
        kept.append(part)
    last = max(i for i, part in enumerate(kept) if isinstance(part, str))
    kept[last] += f" [... {total - max_chars} more characters]"
    return kept


def cut_answer(messages: list[dict], max_chars: int) -> list[dict]:
    """A turn's answer, its messages' contents as parts, with their text cut to `max_chars`
    characters in all and to one message a token of the budget (max_chars //
    RESULT_CHARS_PER_TOKEN: each costs a token at least; 0: as they are), what was left out said at
    the end of the last message kept. 40,000 messages of "ok" with max_chars 800 -> the first 100,
    the last's "ok [... 39,900 more messages, 79,800 more characters]"."""
    most = max(1, max_chars // RESULT_CHARS_PER_TOKEN)
    lengths = [sum(len(part) for part in m["content"] if isinstance(part, str)) for m in messages]
    if not max_chars or len(messages) <= most and sum(lengths) <= max_chars:
        return messages
    kept, left = [], max_chars
    for message in messages[:most]:
        parts = [part[:left] if isinstance(part, str) else part for part in message["content"]]
        kept.append({**message, "content": parts})
        left -= sum(len(part) for part in parts if isinstance(part, str))
        if left == 0:
            break
    characters, dropped = sum(lengths) - (max_chars - left), len(messages) - len(kept)
    note = ", ".join([f"{dropped:,} more messages"] * bool(dropped)
                     + [f"{characters:,} more characters"] * bool(characters))
    last = kept[-1]["content"]
    if last and isinstance(last[-1], str):
        last[-1] += f" [... {note}]"
    else:
        last.append(f"[... {note}]")
    return kept


def content(parts: list) -> str | list[dict]:
    """A message's content: its text, or (with an image) a list of parts the chat template renders
    in order."""
    if all(isinstance(part, str) for part in parts):
        return "\n".join(parts)
    return [{"type": "image", "image": part} if isinstance(part, Image.Image)
            else {"type": "text", "text": part} for part in parts]


# --------------------------------------------------------------------------------------------------
# The kinds of environment
# --------------------------------------------------------------------------------------------------


class Environment:
    """One episode's environment as the loop plays it: the user's class (None for tool functions
    alone), whose instance the episode's start makes, with the time limit of its calls. A turn is
    answered in two halves, so that the calls of every episode run at once: `turn` says what to
    call, `answered` makes the reply of what the calls gave. The kinds: RespondEnvironment (here)
    and tools.ToolEnvironment."""

    def __init__(self, cls, timeout: float, max_chars: int, processor=None):
        self.cls, self.timeout, self.max_chars, self.processor = cls, timeout, max_chars, processor
        self.name, self.instance, self.row = getattr(cls, "__name__", ""), None, {}

    def start(self, row: dict) -> list[Call]:
        """The call that starts the episode with its dataset row: the instance made, and its reset
        called with the row's columns it takes (copies: what it changes stays its own); none without
        a class."""
        self.row = row
        if self.cls is None:
            return []
        arguments = copy.deepcopy(row)
        self.instance = Unmade("")  # until made

        def begin():
            try:
                instance = self.cls()
            # in its thread, as reset's failure would be: the episode's, named as the class's
            except BaseException as error:  # noqa: BLE001
                self.instance = Unmade(f"{self.name}() raised {type(error).__name__}: {error}")
                raise
            self.instance = instance
            reset = getattr(instance, "reset", None)
            return None if reset is None else reset(**reset_arguments(reset, arguments))

        return [Call(f"{self.name}.reset", begin, self.timeout)]

    def started(self, outcomes: list[Outcome]) -> Reply:
        """reset's answer: the end of the prompt's user turn (at most one user message), or an error
        said there. An instance that could not be made (Unmade) can answer nothing more."""
        reply = Reply([], calls=len(outcomes), seconds=sum(o.seconds for o in outcomes))
        unmade = isinstance(self.instance, Unmade)
        for outcome in outcomes:
            if not outcome.error and outcome.value is not None:
                try:
                    parts = observation_parts(outcome.value, self.max_chars, self.processor)
                    reply.messages.append({"role": "user", "content": content(parts)})
                except ValueError as problem:
                    outcome.error = f"{self.name}.reset {problem}"
            if outcome.error and unmade:  # its class raised, or the call was not made or ended
                self.instance.error = self.instance.error or outcome.error
            if outcome.error:
                reply.failed(self.instance.error if unmade else outcome.error,
                             outcome.timed_out or unmade)
        return reply

    def turn(self, text: str, final: bool, images: list) -> tuple[dict, list[Call]]:
        """The generated turn `text` as a message of the episode, and the calls that answer it
        (`final`: the episode ends with this turn whatever the answer; `images`: the episode's so
        far, the prompt's then the given ones)."""
        raise NotImplementedError

    def answered(self, outcomes: list[Outcome]) -> Reply:
        """The reply to the turn, from the outcomes of its calls."""
        raise NotImplementedError


class RespondEnvironment(Environment):
    """A class with `respond`: every generated turn reaches it (the last one too), and its answer is
    the next turn the model reads; None ends the episode."""

    def turn(self, text: str, final: bool, images: list) -> tuple[dict, list[Call]]:
        return {"role": "assistant", "content": text}, [
            Call(f"{self.name}.respond", lambda: self.instance.respond(text), self.timeout)]

    def answered(self, outcomes: list[Outcome]) -> Reply:
        [outcome] = outcomes
        reply = Reply([], calls=1, seconds=outcome.seconds)
        if outcome.error:
            reply.failed(outcome.error, outcome.timed_out)
        elif outcome.value is None:
            reply.messages = None
        else:
            try:
                reply.messages = observation_messages(outcome.value, self.max_chars, self.processor)
            except ValueError as problem:
                reply.failed(f"{self.name}.respond {problem}")
        return reply


def reset_arguments(reset: Callable, row: dict) -> dict:
    """The row's columns that `reset` takes: those it names, or all of them with **kwargs (TRL
    passes the row)."""
    parameters = inspect.signature(reset).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return dict(row)
    return {name: row[name] for name in parameters if name in row}


def check_environment(cls, columns: list[str], spec: str) -> None:
    """At start-up: `cls` makes instances with no arguments, and its reset finds every argument it
    needs among the dataset's `columns`; a failure is one line naming --rollout.env."""
    if not inspect.isclass(cls):
        raise ValueError(f"--rollout.env {spec!r} is a {type(cls).__name__}, not a class")
    try:
        inspect.signature(cls).bind()
    except TypeError as error:
        raise ValueError(f"--rollout.env {spec!r}: an environment is made with no arguments, one "
                         f"per episode ({error})") from None
    reset = getattr(cls, "reset", None)
    if reset is not None:
        parameters = list(inspect.signature(reset).parameters.values())[1:]  # after self
        missing = [p.name for p in parameters
                   if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.name not in columns]
        if missing:
            raise ValueError(f"--rollout.env {spec!r}: {cls.__name__}.reset takes {missing}, which "
                             f"the dataset's rows do not hold (their columns: {columns}); give "
                             "them a default or add the columns")


# --------------------------------------------------------------------------------------------------
# TextArena's games
# --------------------------------------------------------------------------------------------------


class TextArenaGame:
    """A single-player game of TextArena (MIT; https://github.com/LeonGuertler/TextArena) as an
    environment: `--rollout.env textarena:GAME` (GAME a registered id such as GuessTheNumber-v0; one
    that downloads nothing: Wordle and the word games fetch word lists). reset(seed) starts the game
    (its `-raw` version, whose observations come one message at a time) and returns its first
    observation; respond(turn) plays the turn as the game's action and returns what the game says to
    it, or None when the game is over, its reward (0 to 1: 1 a win) in `reward`. TextArena draws
    from Python's global random (seeded at reset), so its calls take turns under one lock: a game's
    turn is microseconds, and the same seed gives the same game whatever runs beside it.
    """

    game = ""  # the TextArena id, set by the class `textarena:GAME` makes (environment_class)
    LOCK = threading.Lock()

    def reset(self, seed: int = 0) -> str:
        import textarena

        with self.LOCK:
            self.env, self.reward = textarena.make(f"{self.game}-raw"), 0.0
            self.env.reset(num_players=1, seed=seed)
            return self.observe()

    def respond(self, turn: str) -> str | None:
        with self.LOCK:
            done, _ = self.env.step(turn)
            if done:
                rewards, _ = self.env.close()
                self.reward = float((rewards or {}).get(0, 0.0))
                return None
            return self.observe()

    def observe(self) -> str:
        """The game's messages to the player since the last turn (not the player's own action, which
        it echoes)."""
        player, messages = self.env.get_observation()
        return "\n".join(message.strip() for sender, message, _ in messages if sender != player)


SINGLE_PLAYER = "single-player games include GuessTheNumber-v0, Mastermind-v0, TowerOfHanoi-v0"


def check_one_player(game: str, spec: str) -> None:
    """At start-up: the TextArena `game` is played by one player. A game says how many it takes only
    when reset, so it is reset once here, for one player (Python's random, which the game seeds, put
    back as it was); a refusal that speaks of players is one line naming --rollout.env. Any other
    failure is left to the episodes' resets, where it is said."""
    import random

    import textarena

    state = random.getstate()
    try:
        with TextArenaGame.LOCK:
            textarena.make(f"{game}-raw").reset(num_players=1, seed=0)
    except Exception as error:
        if "player" in str(error).lower():
            raise ValueError(f"--rollout.env {spec!r}: {game} is not a game of one player ("
                             f"{error}); TextArenaGame plays one side only, and TextArena's "
                             f"{SINGLE_PLAYER}") from None
    finally:
        random.setstate(state)


def environment_class(spec: str):
    """The class `--rollout.env` names: a built-in task's (NAME: the `environment` of tasks/NAME.py
    or tasks/NAME_env.py), `textarena:GAME`, `path/to/file.py:Class` or `module:Class`."""
    builtin = task_piece(spec, "environment", "env")
    if builtin is not None:
        return builtin
    if spec.startswith("textarena:"):
        try:
            from textarena.envs.registration import ENV_REGISTRY
        except ImportError:
            raise ValueError(f"--rollout.env {spec!r} needs TextArena: "
                             "pip install textarena") from None
        game = spec.removeprefix("textarena:")
        if game not in ENV_REGISTRY:
            raise ValueError(f"--rollout.env {spec!r}: TextArena has no game {game!r} (its "
                             f"{SINGLE_PLAYER})")
        check_one_player(game, spec)
        return type(f"TextArena_{game}", (TextArenaGame,), {"game": game})
    return load_object(spec, "env", "--rollout.env",
                       f"a built-in ({', '.join(tasks_with('environment', 'env'))}), "
                       "textarena:GAME")
