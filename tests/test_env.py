"""Environments (env.py), in-process on the CPU: the episode loop with a scripted engine against respond-style games
with state across turns, TRL-shaped classes whose methods are tools, the built-in vault and a TextArena game; reset's
answer ending the prompt's user turn; environments that raise, hang, answer nonsense, never finish or show an image to
a model that reads text; the start-up checks of a class; the `env` reward. Every expected token list is spelled out
with the character tokenizer (`ids`); the real Qwen2.5 vocabulary checks that an answer tokenized on its own is the
whole conversation's rendering (token in, token out). Engines under torchrun: tests/test_episodes.py.
"""

import itertools
import os
import pickle
import random
import sys
import threading
import time

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

import features.episodes as episodes_module
import grpo
from data import DataConfig, PromptDataset
from features.env import (Episode, RespondEnvironment, TextArenaGame, Unmade, check_environment, cut_answer,
                          environment_class)
from features.episodes import EpisodeRollout, episodes_of
from plumbing.tiny import build_qwen_tokenizer, build_tiny_model
from rewards import RewardConfig, RewardError, RewardFunction, env_reward, reward_inputs
from rollout import Response, RolloutConfig
from test_tools import IM_END, IM_START, IMAGE_PAD, VISION_END, VISION_START, ScriptedEngine, ids, turn
from features.tools import ToolConfig, ToolEnvironment, load_parser, methods, tool_schema
from tasks.toy_env import ToyVault
from tasks.toy_env import rows as toy_env_rows

QWEN_IM_END = 151645
# the prompt of a row whose user text is "go", left open (data.py's open_turn), and what ends that turn
OPEN_PROMPT = [IM_START] + ids("user\ngo")
ENDING = [IM_END] + ids("\n") + [IM_START] + ids("assistant\n")


def answer(text: str, ended: bool = True) -> list[int]:
    """The ids of an environment's answer `text` after a generated turn: the end token when the turn was cut before
    it, the newline after `<|im_end|>`, the user turn and the next assistant header."""
    return ([] if ended else [IM_END]) + ids("\n") + [IM_START] + ids("user\n" + text) + ENDING


def item(row: dict, prompt: list[int] = OPEN_PROMPT) -> dict:
    return {"prompt": "", "prompt_ids": list(prompt), "images": [], "videos": [], "row": row, "ground_truth": ""}


def episodes(cls, tokenizer, script, rows=({},), processor=None, **changes) -> tuple[list[list[Response]],
                                                                                    ScriptedEngine]:
    """Episodes of `cls` (respond-style) for one prompt per row, as grpo.episodes_of plays them."""
    cfg = RolloutConfig(**{**dict(n=1, max_response_length=96, max_turns=4, max_turn_tokens=0), **changes})
    engine = ScriptedEngine(script)
    rollout = EpisodeRollout(engine, cfg, lambda: RespondEnvironment(cls, cfg.env_timeout, 8 * cfg.max_response_length,
                                                                     processor),
                             tokenizer, processor, torch.device("cpu"), opens_prompt=True)
    return rollout.generate([item(row) for row in rows], 3), engine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_tiny_model("qwen2", tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def said(monkeypatch, capsys):
    """The lines the episode loop says on the console, as the first rank to report each (the module's process group
    keeps a report's key for the whole module otherwise)."""
    monkeypatch.setattr(episodes_module, "first_to_report", lambda key: True)
    return lambda: capsys.readouterr().err.splitlines()


class Higher:
    """A game with state across turns: the number is the row's; each guess is answered "higher", "lower", or ends the
    game (reward 1, less 0.25 a wrong guess before)."""

    def reset(self, number: int) -> str:
        self.number, self.guesses, self.reward = number, 0, 0.0
        return " 1-9?"

    def respond(self, turn: str) -> str | None:
        self.guesses += 1
        guess = int(turn)
        if guess == self.number:
            self.reward = 1.0 - 0.25 * (self.guesses - 1)
            return None
        return "higher" if guess < self.number else "lower"


def test_a_respond_style_game_with_state_across_turns(tokenizer, world_of_one):
    """reset's answer ends the user's turn; each guess gets the game's answer, given, until the right one ends it; the
    ids, mask and log-probs turn by turn; the messages; the environment keeps the score, which `env` reads."""
    [[response]], engine = episodes(Higher, tokenizer, [[[turn("5", logprob=-0.5)]], [[turn("7")]], [[turn("6")]]],
                                    rows=[{"number": 6, "other": "x"}])
    first, higher, lower = ids(" 1-9?") + ENDING, answer("higher"), answer("lower")
    assert (len(first), len(higher), len(lower)) == (18, 26, 25)
    assert response.token_ids == first + ids("5") + [IM_END] + higher + ids("7") + [IM_END] + lower + ids("6") + [
        IM_END]
    assert response.mask == [0] * 18 + [1, 1] + [0] * 26 + [1, 1] + [0] * 25 + [1, 1]
    assert response.logprobs[:20] == [0.0] * 18 + [-0.5, -0.5]
    # each turn's prompt: the prompt and the episode so far, exactly; the first samples the group's n (one request)
    assert [call["prompt_ids"] for call in engine.calls] == [
        [OPEN_PROMPT + first], [OPEN_PROMPT + response.token_ids[:46]], [OPEN_PROMPT + response.token_ids[:73]]]
    assert [call["n"] for call in engine.calls] == [None, 1, 1]
    episode = response.episode
    assert (episode.stop_reason, episode.turns, episode.calls, episode.errors) == ("done", 3, 4, 0)
    assert episode.messages == [{"role": "user", "content": " 1-9?"}, {"role": "assistant", "content": "5"},
                                {"role": "user", "content": "higher"}, {"role": "assistant", "content": "7"},
                                {"role": "user", "content": "lower"}, {"role": "assistant", "content": "6"}]
    assert episode.environment.reward == 0.5 and not response.truncated
    [inp] = reward_inputs(tokenizer, [item({"number": 6})], [[response]])
    assert inp["env"] is episode.environment and inp["episode"] is episode and inp["response"] == "6"
    assert env_reward(inp) == {"overall": 0.5}


def test_the_prompt_is_left_open_and_reset_ends_the_users_turn(tokenizer):
    """data.py leaves the user's turn open for an environment class: the prompt's text ends with the user's text, and
    ending it with nothing (a reset that returns None) gives back the whole prompt, token for token."""
    rows = datasets.Dataset.from_list([{"problem": "go", "answer": ""}])
    closed, opened = (PromptDataset(rows, DataConfig(), tokenizer, "rows", open_turn=open_turn)[0]
                      for open_turn in (False, True))
    assert opened["prompt"] == "<|im_start|>user\ngo" and opened["prompt_ids"] == OPEN_PROMPT
    assert closed["prompt_ids"] == OPEN_PROMPT + ENDING


class Silent:
    """reset says nothing; every turn is answered with the turn's number, and the fourth ends the episode."""

    def reset(self, **row) -> None:
        self.row, self.turns = row, 0

    def respond(self, turn: str) -> str | None:
        self.turns += 1
        return None if self.turns == 4 else str(self.turns)


def test_a_reset_that_says_nothing_ends_the_turn_with_the_template_alone(tokenizer, world_of_one):
    """The episode begins with the end of the user's turn, given; reset(**row) got the whole row (TRL's way)."""
    [[response]], _ = episodes(Silent, tokenizer, [[[turn("a")]], [[turn("b")]]], rows=[{"a": 1, "b": [2]}],
                               max_turns=2)
    assert response.token_ids == ENDING + ids("a") + [IM_END] + answer("1") + ids("b") + [IM_END]
    assert response.episode.environment.row == {"a": 1, "b": [2]}
    assert response.episode.stop_reason == "max_turns" and response.episode.messages[0] == {
        "role": "assistant", "content": "a"}


def test_an_environment_that_never_says_done_sees_the_last_turn_and_ends_at_max_turns(tokenizer, world_of_one):
    """max_turns 2: respond is called on both turns (the last too: the score may depend on it), its last answer is not
    shown; stop reason max_turns."""
    [[response]], engine = episodes(Silent, tokenizer, [[[turn("a")]], [[turn("b")]]], max_turns=2)
    assert response.episode.environment.turns == 2 and response.episode.calls == 3  # reset and two responds
    assert len(engine.calls) == 2 and response.token_ids[-2:] == ids("b") + [IM_END]


class Broken:
    """Fails in the way `how` says: reset raises (where the row does not say otherwise), respond raises, hangs, ends or
    forks the process, or answers with no observation."""

    how = ""
    release = threading.Event()

    def reset(self, fails: bool = True) -> str:
        if self.how == "reset raises" and fails:
            raise KeyError("no board")
        return ""

    def respond(self, turn: str):
        if self.how == "respond raises":
            raise ValueError(f"cannot read {turn!r}")
        if self.how == "respond hangs":
            self.release.wait(30)
        if self.how == "respond exits":
            os._exit(3)
        if self.how == "respond forks":
            os.fork()
        return {"wins": 1} if self.how == "answers a dict" else 42


def broken(how: str):
    return type("Broken", (Broken,), {"how": how})


def test_an_environment_that_raises_is_an_error_the_model_reads_until_max_env_errors(tokenizer, world_of_one, said):
    """respond raising: the model reads `error: ...` and goes on; --rollout.max-env-errors ends the episode. The
    first failure is said on the console, once, naming the environment and the exception; the others are counted."""
    [[response]], _ = episodes(broken("respond raises"), tokenizer, [[[turn("a")]], [[turn("b")]]], max_env_errors=2)
    message = "error: Broken.respond raised ValueError: cannot read 'a'"
    assert response.token_ids == ENDING + ids("a") + [IM_END] + answer(message) + ids("b") + [IM_END]
    assert (response.episode.stop_reason, response.episode.errors, response.episode.turns) == ("errors", 2, 2)
    assert response.episode.messages[2] == {"role": "user", "content": message}
    assert said() == ["warning: Broken.respond raised ValueError: cannot read 'a'; the model reads the error, "
                      "--rollout.max-env-errors of them end the episode, counted in `episode/errors` from now on "
                      "without a message"]


@pytest.mark.parametrize("how", ["respond exits", "respond forks"])
def test_an_environment_that_would_end_or_fork_the_process_fails_its_call(tokenizer, world_of_one, how):
    """os._exit in respond would end the rank with no word of why, and os.fork's child would go on running the
    trainer: in an environment's call both raise instead, the call's failure, which the model reads."""
    pid = os.getpid()
    [[response]], _ = episodes(broken(how), tokenizer, [[[turn("a")]], [[turn("b")]]], max_turns=2,
                               max_response_length=400)
    assert os.getpid() == pid  # (a forked child would be here too, and fail this)
    call = "os._exit(3) would end the trainer's process" if how == "respond exits" else (
        "os.fork() would copy the trainer's process, whose child would go on running the trainer")
    assert response.episode.messages[2]["content"].startswith(f"error: Broken.respond raised Refused: {call}")
    assert (response.episode.stop_reason, response.episode.errors) == ("max_turns", 2)


def test_a_reset_that_raises_is_said_where_its_answer_would_be(tokenizer, world_of_one, said):
    """reset raising: the error ends the user's turn instead of reset's answer, counted; the episode goes on, and
    another episode of the step starts as usual. The first failure is said on the console, once."""
    [[response], [other]], _ = episodes(broken("reset raises"), tokenizer, [[[turn("a")], [turn("a")]],
                                                                            [[turn("b")], [turn("b")]]],
                                        rows=[{}, {"fails": False}], max_turns=2, max_response_length=200)
    assert response.token_ids[:len(ids("error: Broken.reset raised KeyError: 'no board'"))] == ids(
        "error: Broken.reset raised KeyError: 'no board'")
    # and both answers, 42, are no observation: three failed calls, --rollout.max-env-errors' default
    assert response.episode.errors == 3 and response.episode.stop_reason == "errors"
    assert other.episode.errors == 2 and other.token_ids[:len(ENDING)] == ENDING
    start, answers = said()  # the first failed start, the first failed answer (42s): once each
    assert start == ("warning: an episode failed to start: Broken.reset raised KeyError: 'no board'; it goes on "
                     "without reset's answer, counted in `episode/errors` from now on without a message")
    assert answers.startswith("warning: Broken.respond returned int 42, which is no observation")


def test_a_step_whose_every_episode_fails_to_start_is_the_runs_error(tokenizer, world_of_one, said):
    """Every reset of the step failing (over all ranks), the run would train on nothing: one error naming
    --rollout.env and the first failure, after the console's warning."""
    with pytest.raises(ValueError, match=r"^--rollout.env 'x.py:Broken': all 2 episodes of the step failed to start, "
                                         r"the first: Broken.reset raised KeyError: 'no board'$"):
        episodes(broken("reset raises"), tokenizer, [], rows=[{}, {}], env="x.py:Broken")
    assert len(said()) == 1


class Flaky:
    """Made twice: the second time its constructor raises, or calls sys.exit, as `how` says; made, it ends the episode
    at its first turn with a reward of 1."""

    how = "raises"
    made = itertools.count()

    def __init__(self):
        if next(self.made) % 2 == 1:
            if self.how == "exits":
                sys.exit(3)
            raise RuntimeError("no board")
        self.reward = 1.0

    def respond(self, turn: str) -> None:
        return None


@pytest.mark.parametrize("how, error", [("raises", "RuntimeError: no board"), ("exits", "SystemExit: 3")])
def test_a_class_that_raises_when_made_fails_its_episode_not_the_run(tokenizer, world_of_one, how, error):
    """A constructor that raises (or exits) for one episode: that episode's failure, named as the class's, counted as
    a failed reset is; its first turn is generated and the episode ends (stop reason errors); `--reward.function env`
    scores it 0 and the other episode as its environment kept. Before, the episode's environment was None, which the
    reward took for a run without --rollout.env: the run's error."""
    flaky = type("Flaky", (Flaky,), {"how": how, "made": itertools.count()})
    groups, _ = episodes(flaky, tokenizer, [[[turn("a")], [turn("a")]]], rows=[{}, {}])
    [made] = [r for [r] in groups if not r.episode.errors]
    [unmade] = [r for [r] in groups if r.episode.errors]
    assert unmade.episode.messages[:2] == [{"role": "user", "content": f"error: Flaky() raised {error}"},
                                           {"role": "assistant", "content": "a"}]
    assert (unmade.episode.stop_reason, unmade.episode.errors, unmade.episode.calls) == ("errors", 1, 1)
    assert unmade.episode.environment == Unmade(f"Flaky() raised {error}")
    assert made.episode.stop_reason == "done"
    scores = [env_reward(inp)["overall"] for inp in reward_inputs(tokenizer, [item({}), item({})], groups)]
    assert scores == [float(response is made) for [response] in groups]


class Rules:
    """reset answers with the row's rules, however long."""

    def reset(self, rules: str) -> str:
        return rules

    def respond(self, turn: str) -> None:
        return None


def test_a_reset_answer_too_long_for_the_budget_is_a_failed_start_said_with_its_length(tokenizer, world_of_one,
                                                                                         said):
    """An answer of 120 characters (133 tokens with the end of the user's turn) leaves nothing of a budget of 96 to
    generate: the episode begins without it, a failed call, said once on the console with the count; a short one in
    the same step is shown."""
    [[cut], [shown]], _ = episodes(Rules, tokenizer, [[[turn("a")], [turn("a")]]],
                                   rows=[{"rules": "r" * 120}, {"rules": "go"}])
    problem = ("Rules.reset's answer is 133 tokens with the end of the user's turn, which leaves none of "
               "--rollout.max-response-length 96 to generate: raise it")
    assert cut.token_ids == ENDING + ids("a") + [IM_END] and cut.episode.errors == 1
    assert shown.token_ids == ids("go") + ENDING + ids("a") + [IM_END] and shown.episode.errors == 0
    assert said() == [f"warning: an episode failed to start: {problem}; it goes on without reset's answer, counted "
                      "in `episode/errors` from now on without a message"]


class Flood:
    """Answers every turn with 40,000 short messages."""

    def reset(self) -> None:
        return None

    def respond(self, turn: str) -> list[dict]:
        return [{"role": "user", "content": "ok"}] * 40_000


def test_an_answer_of_40000_messages_is_cut_as_a_whole_and_quickly(tokenizer, world_of_one):
    """The cut on an answer's size is on the whole answer, not each message: its text at 8 characters a token of the
    budget in all, and one message a token (96 here); so the 40,000 messages cost the turn the rendering of 96 (before:
    all 40,000, seconds with the tiny model's template), and the answer, still too long to follow, ends the episode
    (stop reason length, counted in `episode/stop_length`)."""
    engine = ScriptedEngine([[[turn("a")]]])
    cfg = RolloutConfig(n=1, max_response_length=96, max_turns=4, max_turn_tokens=0)
    rollout = EpisodeRollout(engine, cfg, lambda: RespondEnvironment(Flood, cfg.env_timeout, 8 * 96), tokenizer, None,
                             torch.device("cpu"), opens_prompt=True)
    rendered, after_turn = [], rollout.render.after_turn
    rollout.render.after_turn = lambda messages, ended: rendered.append(len(messages)) or after_turn(messages, ended)
    start = time.perf_counter()
    [[response]] = rollout.generate([item({})], 3)
    assert time.perf_counter() - start < 2
    assert rendered == [96] and (response.episode.stop_reason, response.episode.turns) == ("length", 1)
    [kept] = [m["content"] for m in cut_answer([{"role": "user", "content": ["ok"]}] * 40_000, 800)[-1:]]
    assert kept == ["ok [... 39,900 more messages, 79,800 more characters]"]
    assert cut_answer([{"role": "user", "content": ["abc"]}, {"role": "tool", "content": ["defgh"]}], 64) == [
        {"role": "user", "content": ["abc"]}, {"role": "tool", "content": ["defgh"]}]
    assert cut_answer([{"role": "user", "content": ["abc"]}, {"role": "tool", "content": ["defgh"]}], 16 + 4) == [
        {"role": "user", "content": ["abc"]}, {"role": "tool", "content": ["defgh"]}]


@pytest.mark.parametrize("how, error", [
    ("answers a dict", "Broken.respond returned the message {'wins': 1}; a message is {'role': ..., 'content': ...}"),
    ("answers 42", "Broken.respond returned int 42, which is no observation: give text, an image, a list of them, "
                   "or messages")])
def test_an_answer_that_is_no_observation_is_an_error(tokenizer, world_of_one, how, error):
    [[response]], _ = episodes(broken(how), tokenizer, [[[turn("a")]], [[turn("b")]]], max_turns=2,
                               max_response_length=200)
    assert response.episode.messages[2] == {"role": "user", "content": f"error: {error}"}
    assert response.episode.errors == 2  # the second answer, to the last turn, is not read but counted


def test_an_environment_that_hangs_ends_its_episode_and_the_others_go_on(tokenizer, world_of_one):
    """respond past --rollout.env-timeout: the episode ends (its environment is still busy) with stop reason errors,
    whatever --rollout.max-env-errors says; the hanging call is abandoned; another episode of the turn goes on."""
    hangs = broken("respond hangs")
    made = iter([hangs, Silent])
    cfg = RolloutConfig(n=1, max_response_length=96, max_turns=2, env_timeout=0.2, max_env_errors=0)
    engine = ScriptedEngine([[[turn("a")], [turn("a")]], [[turn("b")]]])
    rollout = EpisodeRollout(engine, cfg, lambda: RespondEnvironment(next(made), cfg.env_timeout, 800),
                             tokenizer, None, torch.device("cpu"), opens_prompt=True)
    try:
        [[stuck], [going]] = rollout.generate([item({}), item({})], 3)
    finally:
        Broken.release.set()
    assert (stuck.episode.stop_reason, stuck.episode.errors, stuck.episode.turns) == ("errors", 1, 1)
    assert stuck.token_ids == ENDING + ids("a") + [IM_END]
    assert (going.episode.stop_reason, going.episode.turns) == ("max_turns", 2)
    assert engine.calls[1]["prompt_ids"] == [OPEN_PROMPT + ENDING + ids("a") + [IM_END] + answer("1")]


class Picture:
    """Shows a picture at reset and in its answer."""

    def reset(self) -> list:
        return ["look:", Image.new("RGB", (56, 56), (255, 0, 0))]

    def respond(self, turn: str) -> list:
        return [Image.new("RGB", (56, 56), (0, 0, 255)), "again"]


def test_an_image_to_a_text_model_is_an_error(tokenizer, world_of_one):
    """respond's picture is an error the model reads; reset's, in every episode, fails every start: the run's
    error."""
    says_look = type("Picture", (Picture,), {"reset": lambda self: "look"})
    [[response]], _ = episodes(says_look, tokenizer, [[[turn("a")]], [[turn("b")]]], max_turns=2,
                               max_response_length=200)
    assert response.episode.messages[2] == {"role": "user", "content": "error: Picture.respond returned an image, "
                                                                       "but the model reads text only"}
    with pytest.raises(ValueError, match="the first: Picture.reset returned an image, but the model reads text only"):
        episodes(Picture, tokenizer, [[[turn("a")]]], max_turns=1)


@pytest.fixture(scope="module")
def vl_processor(tmp_path_factory):
    return AutoProcessor.from_pretrained(build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("tiny_vl") / "model"))


def test_images_from_an_environment_join_the_episode_and_count_their_tokens(vl_processor, world_of_one):
    """reset's picture ends the user's turn and respond's is in its answer: each one `<|image_pad|>` in the ids (4
    image tokens a 56 x 56 picture), in the episode's images in order, and in the next turn's prompt."""
    [[response]], engine = episodes(Picture, vl_processor.tokenizer, [[[turn("a")]], [[turn("b")]]], max_turns=2,
                                    processor=vl_processor)
    picture = [VISION_START, IMAGE_PAD, VISION_END]
    first = ids("look:") + picture + ENDING
    later = ids("\n") + [IM_START] + ids("user\n") + picture + ids("again") + ENDING
    assert response.token_ids == first + ids("a") + [IM_END] + later + ids("b") + [IM_END]
    assert [image.getpixel((0, 0)) for image in response.images] == [(255, 0, 0), (0, 0, 255)]
    assert engine.calls[1]["images"] == [response.images]
    assert engine.calls[0]["max_tokens"] == [96 - len(first) - 3]  # the picture is 4 tokens, its placeholder 1


def test_the_built_in_vault_needs_the_environments_answer(tokenizer, world_of_one):
    """toy_env: the vault answers the first turn with its clue, then scores the answer: the code alone 1.0, the code
    and more 0.5, another digit 0."""
    row = toy_env_rows("test")[0]
    assert row == {"problem": "eszy", "answer": "2", "clue": "2221512"}
    rewards = []
    for said in ("2", "22", "5"):
        [[response]], _ = episodes(ToyVault, tokenizer, [[[turn("hi")]], [[turn(said)]]], rows=[row], max_turns=2)
        assert response.token_ids == ENDING + ids("hi") + [IM_END] + answer("2221512") + ids(said) + [IM_END]
        assert response.episode.stop_reason == "done"
        rewards.append(response.episode.environment.reward)
    assert rewards == [1.0, 0.5, 0.0]


def test_a_textarena_game_is_played_turn_by_turn(tokenizer, world_of_one):
    """textarena:GuessTheNumber-v0 (1 to 20, its -raw observations): the number of seed 3 is 8 (the game's own
    random.randint after its seed); [10] is answered "lower", [2] "higher", [8] wins: reward 1."""
    game = environment_class("textarena:GuessTheNumber-v0")
    assert issubclass(game, TextArenaGame) and game.game == "GuessTheNumber-v0"
    [[response]], _ = episodes(game, tokenizer, [[[turn("[10]")]], [[turn("[2]")]], [[turn("[8]")]]],
                               rows=[{"problem": "", "answer": "", "seed": 3}], max_response_length=800)
    messages = response.episode.messages
    assert messages[0]["content"].startswith("You are Player 0. You are playing Guess The Number.")
    assert [m["content"] for m in messages[1:]] == ["[10]", "The target number is lower.", "[2]",
                                                    "The target number is higher.", "[8]"]
    assert response.episode.stop_reason == "done" and response.episode.environment.reward == 1.0
    with pytest.raises(ValueError, match="TextArena has no game 'Nothing-v0'"):
        environment_class("textarena:Nothing-v0")


def test_a_textarena_game_of_two_players_is_refused_at_start_up():
    """TextArenaGame plays one side: a two-player game (its reset for one player raises, at start-up) is one line
    naming --rollout.env; the trial leaves Python's random as it was (the game seeds it)."""
    with pytest.raises(ValueError, match=r"^--rollout.env 'textarena:TicTacToe-v0': TicTacToe-v0 is not a game of one "
                                         r"player \(The number of players has to be 2, received 1\)"):
        environment_class("textarena:TicTacToe-v0")
    random.seed(5)
    drawn = random.random()
    random.seed(5)
    environment_class("textarena:GuessTheNumber-v0")
    assert random.random() == drawn


class Counter:
    """TRL's environment shape: reset(**kwargs) -> str, public methods as tools, get_reward."""

    def reset(self, **kwargs) -> str:
        self.count, self.start = 0, kwargs["start"]
        return f"Start at {self.start}."

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much
        """
        self.count += amount
        return str(self.start + self.count)

    def get_reward(self) -> float:
        return float(self.count)


def test_a_trl_environment_class_runs_unchanged_its_methods_the_tools(tokenizer, world_of_one):
    """The class's public methods but reset and get_reward are the tools (their schemas without self); reset(**row)
    ends the user's turn; each call changes the instance's state; a turn without a call ends the episode; `env` reads
    get_reward()."""
    assert list(methods(Counter)) == ["add"]
    assert tool_schema(methods(Counter)["add"])["function"]["parameters"] == {
        "type": "object", "properties": {"amount": {"type": "integer", "description": "how much"}},
        "required": ["amount"]}
    cfg = RolloutConfig(n=1, max_response_length=400, max_turns=4)
    parse = load_parser("qwen")
    engine = ScriptedEngine([[[turn('<tool_call>{"name": "add", "arguments": {"amount": 2}}</tool_call>')]],
                             [[turn('<tool_call>{"name": "add", "arguments": {"amount": 3}}</tool_call>')]],
                             [[turn("done")]]])
    rollout = EpisodeRollout(engine, cfg, lambda: ToolEnvironment(Counter, {}, parse, ToolConfig(), cfg.env_timeout,
                                                                  1600),
                             tokenizer, None, torch.device("cpu"), opens_prompt=True)
    [[response]] = rollout.generate([item({"start": 10, "answer": ""})], 3)
    episode = response.episode
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert episode.messages[0]["content"] == "Start at 10." and response.token_ids[:len(ids("Start"))] == ids("Start")
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["12", "15"]
    assert episode.messages[1] == {"role": "assistant", "content": "", "tool_calls": [{"name": "add",
                                                                                       "arguments": {"amount": 2}}]}
    assert (episode.stop_reason, episode.calls, episode.environment.count) == ("done", 3, 5)  # reset, 2 calls
    [inp] = reward_inputs(tokenizer, [item({"start": 10})], [[response]])
    assert env_reward(inp) == {"overall": 5.0}


def test_episodes_of_reads_the_flags_into_the_kind_of_environment(tokenizer):
    """--rollout.env with respond: respond-style, prompts left open, no tools; a TRL class: its methods as tools,
    beside --tools.functions; tool functions alone: the prompt closed; neither: one turn. A class with neither respond
    nor a public method, or respond with tool functions, is refused naming the flags."""
    def episodes_for(*argv):
        cfg = grpo.parse_config(list(argv))
        return episodes_of(cfg.rollout, cfg.tools, None)

    respond = episodes_for("--rollout.env", "toy")
    assert respond.opens_prompt and respond.schemas == [] and isinstance(respond.environment(), RespondEnvironment)
    trl = episodes_for("--rollout.env", "tests/test_env.py:Counter", "--tools.functions", "calculator")
    assert trl.opens_prompt and [s["function"]["name"] for s in trl.schemas] == ["calculate", "add"]
    functions = episodes_for("--tools.functions", "toy")
    assert not functions.opens_prompt and isinstance(functions.environment(), ToolEnvironment)
    assert episodes_for() is None
    with pytest.raises(ValueError, match="has neither `respond` nor a public method"):
        episodes_for("--rollout.env", "tests/test_env.py:Episode")
    with pytest.raises(ValueError, match="--tools.functions with --rollout.env 'toy'"):
        episodes_for("--rollout.env", "toy", "--tools.functions", "calculator")


class NeedsArguments:
    def __init__(self, size: int):
        self.size = size

    def respond(self, turn: str) -> None:
        return None


class NeedsAColumn:
    def reset(self, board: str, seed: int = 0) -> None:
        self.board = board

    def respond(self, turn: str) -> None:
        return None


def test_a_class_that_cannot_be_made_or_reset_from_the_rows_is_refused_at_start_up():
    """Made with no arguments, one per episode; reset's arguments without a default must be columns of the rows."""
    with pytest.raises(ValueError, match="an environment is made with no arguments"):
        check_environment(NeedsArguments, ["problem"], "x.py:NeedsArguments")
    with pytest.raises(ValueError, match=r"NeedsAColumn.reset takes \['board'\], which the dataset's rows do not hold"):
        check_environment(NeedsAColumn, ["problem", "seed"], "x.py:NeedsAColumn")
    check_environment(NeedsAColumn, ["problem", "board"], "x.py:NeedsAColumn")
    with pytest.raises(ValueError, match="not a class"):
        check_environment(len, [], "x.py:len")
    with pytest.raises(ValueError, match="--rollout.env 'nowhere.py': no such file"):
        environment_class("nowhere.py:Game")


def test_the_env_reward_reads_the_environments_score():
    """get_reward() first, else `reward`; an environment without either is the run's error; a failed episode whose
    environment kept nothing scores 0; a sample without an environment is refused."""
    def scored(env, errors=0):
        return env_reward({"env": env, "episode": Episode(errors=errors)})

    assert scored(type("E", (), {"reward": 0.25})()) == {"overall": 0.25}
    assert scored(type("E", (), {"get_reward": lambda self: 2, "reward": 9})()) == {"overall": 2.0}
    assert scored(type("E", (), {})(), errors=1) == {"overall": 0.0}
    with pytest.raises(RewardError, match="keeps no score"):
        scored(type("E", (), {})())
    with pytest.raises(RewardError, match="set --rollout.env"):
        env_reward({"env": None, "episode": None})
    assert RewardFunction(RewardConfig("env")).fn is env_reward


def test_an_answer_on_its_own_is_the_whole_conversations_rendering_in_qwens_vocabulary(world_of_one):
    """Real Qwen2.5 BPE: the open prompt, reset's answer with the end of the turn, a canonical generated turn and
    respond's answer, appended id by id, are the tokens of the whole conversation rendered at once (the user's text
    and reset's answer one message, as TRL renders it); a turn sampled in other pieces keeps its own ids."""
    tok = build_qwen_tokenizer()
    rows = datasets.Dataset.from_list([{"problem": "Let's play.", "answer": ""}])
    prompt = PromptDataset(rows, DataConfig(), tok, "rows", open_turn=True)[0]["prompt_ids"]
    whole = tok.apply_chat_template([{"role": "user", "content": "Let's play. Guess my number."},
                                     {"role": "assistant", "content": "Is it ten?"},
                                     {"role": "user", "content": "Higher."}], add_generation_prompt=True,
                                    return_dict=False)

    class Game:
        def reset(self) -> str:
            return " Guess my number."

        def respond(self, turn: str) -> str:
            return "Higher."

    canonical = tok.encode("Is it ten?", add_special_tokens=False) + [QWEN_IM_END]
    by_character = [tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in "Is it ten?"] + [QWEN_IM_END]
    assert len(by_character) > len(canonical) and tok.decode(by_character) == tok.decode(canonical)
    for generated in canonical, by_character:
        engine = ScriptedEngine([[[Response(generated, [-0.5] * len(generated), False)]], [[turn("x")]]])
        rollout = EpisodeRollout(engine, RolloutConfig(n=1, max_response_length=64, max_turns=2),
                                 lambda: RespondEnvironment(Game, 30, 512), tok, None, torch.device("cpu"), True)
        [[response]] = rollout.generate([item({}, prompt)], 3)
        first = response.mask.index(1)
        assert response.token_ids[first:first + len(generated)] == generated  # as sampled
        episode_so_far = prompt + response.token_ids[:first + len(generated) + response.mask[
            first + len(generated):].index(1)]
        assert engine.calls[1]["prompt_ids"] == [episode_so_far]
        assert (episode_so_far == whole) == (generated is canonical)


def test_an_episode_travels_to_another_rank_without_its_environment():
    """Sequence parallelism pickles the groups to the other ranks of a group: the record goes, the environment object
    (a lock, a socket, a game engine) stays behind."""
    episode = Episode(turns=2, calls=3, environment=threading.Lock())
    sent = pickle.loads(pickle.dumps(Response([1], [0.0], False, mask=[1], episode=episode)))
    assert sent.episode.turns == 2 and sent.episode.calls == 3 and sent.episode.environment is None
    assert episode.environment is not None  # the rank's own keeps it
