"""Multi-turn episodes: the loop that plays each sample against its environment (features/env.py's
contract; tools are one kind of environment, features/tools.py), turn after turn, as a rollout
engine of its own (EpisodeRollout); wired into grpo.py by one call (episodes_of).

An episode in tokens, Qwen's format (`|` marks where the model's own tokens end and the given ones
begin), reset having returned " Guess my number." and respond "Higher." to the first guess:
    <|im_start|>user\\nLet's play.                                       <- the prompt
    | Guess my number.<|im_end|>\\n<|im_start|>assistant\\n              <- given: reset's answer
    | [10]<|im_end|>                                                     <- generated
    | \\n<|im_start|>user\\nHigher.<|im_end|>\\n<|im_start|>assistant\\n <- given: respond's answer
    | [15]<|im_end|>                                                     <- generated; respond: None
The trainer's response is everything after the prompt: the given turns are in it (the model reads
them) but masked out of every loss, KL and metric (logprobs.Batch's holed response mask); the
outcome reward is on the last generated token.

Design decisions:
- Token in, token out: the engine's own ids of every generated turn are kept, and only the
  environment's answer (rendered on its own by the chat template, with the next assistant header) is
  tokenized and appended. Nothing generated is ever re-tokenized: decoding a sampled turn and
  encoding it again need not give its tokens back (a sample may split a word as the tokenizer never
  would: tests/test_real_tokenizer.py), and the trainer would then score a sequence the engine never
  sampled. Each turn's prompt is the previous turn's prompt, the ids it generated and the answer, so
  vLLM's prefix cache serves the re-prefill. An environment's text is tokenized as plain text: a
  control token's text in it (`<|im_end|>`) is characters the model reads, not the end of its turn.
- reset's answer completes the user's turn, as in TRL: an environment class's prompts end with the
  user's text (data.py leaves the turn open), and each episode's response begins with the rest of
  that turn, given: reset's observation, the template's end of the turn and the assistant header. So
  the n episodes of a prompt share one prompt whatever each reset returns; an environment whose
  reset says nothing costs those few header tokens.
- All the calls of a turn, over all the episodes of the rank, run at once, each in a thread of its
  own within its time limit (plumbing/calls.py): a slow environment costs a turn its time once, not
  once per episode.
- Ranks take turns in lockstep: a turn is a collective for the hf engine (it gathers the FSDP2
  weights) and for tensor-parallel vLLM, so a rank whose episodes are over joins the others' turns
  with nothing to generate.
- The whole episode fits --rollout.max-response-length tokens, generated and given (an image counts
  as its tokens); each turn may generate what is left, at most --rollout.max-turn-tokens. An answer
  is cut before it is rendered, as a whole (env.cut_answer: 40,000 short messages cost what fits);
  one that still does not fit ends the episode (stop reason `length`) without being added; reset's,
  a failed start.
"""

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from data import OPEN_TURN
from features.env import (RESULT_CHARS_PER_TOKEN, STOP_REASONS, Environment, Episode, Reply,
                          RespondEnvironment, environment_class)
from features.tools import ToolEnvironment, load_parser, load_tools, methods, tool_schema
from model.vision import image_tokens
from plumbing.calls import Call, run_at_once
from plumbing.collectives import all_reduce
from plumbing.console import first_to_report
from rollout import Response, RolloutConfig, sampling

# --------------------------------------------------------------------------------------------------
# Rendering: the environment's answers as the model's chat template writes them
# --------------------------------------------------------------------------------------------------

# what an answer follows
CONVERSATION = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
TEXT = "\ue000{}\ue001"  # marks an environment's text in a rendering, to tokenize it as plain text


class Renderer:
    """The token ids of what an environment says, as the chat template writes it (the tools' schemas
    too): an answer after a generated turn (`after_turn`), or reset's, which ends the prompt's user
    turn (`ending_prompt`)."""

    def __init__(self, tokenizer, processor, schemas: list[dict] | None):
        self.tokenizer, self.processor, self.schemas = tokenizer, processor, schemas or None
        self.head = self.render(CONVERSATION, generation_prompt=False)
        end = tokenizer.eos_token
        if end not in self.head:
            raise ValueError(f"the chat template does not close an assistant turn with the end "
                             f"token {end!r}; a multi-turn rollout needs it to tell where a "
                             "turn ends")
        # the template's text after it (Qwen's: \n)
        self.after_end = self.head[self.head.rindex(end) + len(end):]

    def render(self, messages: list[dict], generation_prompt: bool, tools: bool = True) -> str:
        renderer = self.processor if self.processor is not None else self.tokenizer
        return renderer.apply_chat_template(messages, tools=self.schemas if tools else None,
                                            add_generation_prompt=generation_prompt, tokenize=False)

    def after_turn(self, messages: list[dict], ended: bool) -> tuple[list[int], list]:
        """The ids and images of an answer (`messages`) and the next assistant header, after a
        generated turn; the template's end token first when the turn did not end with it (cut short,
        or ended by another end token: Qwen's `<|endoftext|>`)."""
        marked, texts, images = self.marked(messages)
        text = self.render(CONVERSATION + marked, generation_prompt=True)
        if not text.startswith(self.head):
            raise ValueError("the chat template renders the start of a conversation differently "
                             "once an answer follows, so an answer cannot be rendered on its own")
        start = ("" if ended else self.tokenizer.eos_token) + self.after_end
        return self.ids(start + text[len(self.head):], texts), images

    def ending_prompt(self, messages: list[dict]) -> tuple[list[int], list]:
        """The ids and images that end the prompt's user turn (data.py leaves it open): reset's
        answer (`messages`, at most one user message), the end of the turn and the assistant
        header."""
        marked, texts, images = self.marked(messages)
        parts = marked[0]["content"] if marked else ""
        if isinstance(parts, str):
            user = "x" + OPEN_TURN + parts
        else:  # a list of parts: a vision-language model's processor renders them in order
            user = [{"type": "text", "text": "x" + OPEN_TURN}, *parts]
        text = self.render([{"role": "user", "content": user}], generation_prompt=True)
        return self.ids(text[text.index(OPEN_TURN) + len(OPEN_TURN):], texts), images

    def marked(self, messages: list[dict]) -> tuple[list[dict], list[str], list]:
        """The messages with each text replaced by its TEXT mark, the texts, and the images in
        order."""
        texts, images = [], []

        def mark(text: str) -> str:
            texts.append(text)
            return TEXT.format(len(texts) - 1)

        marked = []
        for message in messages:
            value = message["content"]
            if isinstance(value, str):
                value = mark(value)
            else:
                value = [{**part, "text": mark(part["text"])} if part["type"] == "text" else part
                         for part in value]
                images += [part["image"] for part in message["content"] if part["type"] == "image"]
            marked.append({**message, "content": value})
        return marked, texts, images

    def ids(self, text: str, texts: list[str]) -> list[int]:
        """The ids of a rendering whose marks stand for `texts`: the template's own text tokenized
        as such, each text as plain text (split_special_tokens)."""
        pieces = re.split("\ue000(\\d+)\ue001", text)
        if pieces[1::2] != [str(i) for i in range(len(texts))]:
            raise ValueError("the chat template does not show an environment's text once, as "
                             "given, in its turn")
        ids = []
        for i, piece in enumerate(pieces):
            plain = i % 2 == 1
            ids += self.tokenizer(texts[int(piece)] if plain else piece, add_special_tokens=False,
                                  split_special_tokens=plain)["input_ids"]
        return ids

    def ignores_tools(self) -> bool:
        """The chat template renders a conversation the same with the tools' schemas as without
        them."""
        return bool(self.schemas) and (self.render(CONVERSATION[:1], True)
                                       == self.render(CONVERSATION[:1], True, tools=False))


# --------------------------------------------------------------------------------------------------
# The episode loop
# --------------------------------------------------------------------------------------------------


@dataclass
class Play:
    """One episode being played: its prompt (a dataset item), its environment, and its response so
    far."""

    item: dict
    environment: Environment
    response: Response
    final: bool = False  # the turn just generated is its last, whatever the environment answers


class EpisodeRollout:
    """A rollout engine (rollout.py) whose `generate` plays whole episodes: generate a turn, hand it
    to the episode's environment, append its answer, generate again, until the environment says
    done, --rollout.max-turns turns, the token budget, or --rollout.max-env-errors failed calls. The
    engine's contract: one list of n Responses per prompt, here each with its `mask` (0 on what the
    environment said), its `images` (the environment's) and its `episode`. Weight syncs, sleep and
    shutdown are the engine's own.

    `environments()` makes one episode's Environment; `opens_prompt`: the prompts end with the
    user's text (an environment class's: reset's answer ends the turn); `schemas`: the tools' JSON
    schemas the prompts list.
    """

    def __init__(self, engine, cfg: RolloutConfig, environments: Callable[[], Environment],
                 tokenizer, processor, device: torch.device, opens_prompt: bool = False,
                 schemas: list[dict] | None = None):
        self.engine, self.cfg, self.environments, self.device = engine, cfg, environments, device
        self.tokenizer, self.processor, self.opens_prompt = tokenizer, processor, opens_prompt
        self.render = Renderer(tokenizer, processor, schemas)
        self.warned: set[str] = set()  # the kinds of failure said on the console (warn_once)
        if self.render.ignores_tools() and first_to_report("template ignores tools"):
            print("warning: the chat template ignores `tools`, so the model is not shown the "
                  f"tools ({', '.join(s['function']['name'] for s in schemas)}) and knows them "
                  "only from the prompt", file=sys.stderr, flush=True)
        ending = len(self.render.ending_prompt([])[0]) if opens_prompt else 0
        if ending >= cfg.max_response_length:
            raise ValueError(f"--rollout.max-response-length {cfg.max_response_length} leaves no "
                             f"token to generate after the {ending} that end the prompt's user "
                             "turn (an environment's episode begins with them): raise it")

    # weights_version, sync_weights, sleep, shutdown: the engine's
    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts: list[dict], version: int, validation: bool = False,
                 greedy: bool = False) -> list[list[Response]]:
        """Episodes for `prompts` (dataset items: prompt_ids, images, videos, row): n per prompt, as
        the engine samples."""
        n = sampling(self.cfg, validation, greedy)[0]
        plays = [Play(item, self.environments(),
                      Response([], [], False, mask=[], episode=Episode()))
                 for item in prompts for _ in range(n)]
        self.start(plays)
        live, generate = plays, lambda contexts, count, limits: self.engine.generate(
            contexts, version, validation, greedy, n=count, max_tokens=limits)
        turns = self.first_turns(plays, prompts, n, generate)
        for number in range(1, self.cfg.max_turns + 1):
            calls = [self.add_turn(play, turn, number) for play, turn in zip(live, turns)]
            outcomes = iter(run_at_once([call for play_calls in calls for call in play_calls]))
            for play, play_calls in zip(live, calls):
                if not play.response.episode.stop_reason:
                    self.add_answer(play, play.environment.answered(
                        [next(outcomes) for _ in play_calls]))
            live = [play for play in live if not play.response.episode.stop_reason]
            if all_reduce({"live": len(live)}, self.device,
                          torch.distributed.ReduceOp.MAX)["live"] == 0:
                break  # every rank stops at once: for some engines a turn is a collective
            turns = [group[0] for group in generate([self.context(play) for play in live], 1,
                                                    [self.left(play) for play in live])]
        return [[play.response for play in plays[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def start(self, plays: list[Play]) -> None:
        """Every episode's start at once (an environment class's reset); where the prompt is left
        open, its answer, the end of the prompt's user turn, begins the response. An episode that
        fails to start goes on, its failure counted and the first said on the console; the step's
        episodes all failing, over all ranks, is the run's error: it would train on nothing."""
        calls = [play.environment.start(play.item["row"]) for play in plays]
        outcomes = iter(run_at_once([call for play_calls in calls for call in play_calls]))
        failures = []
        for play, play_calls in zip(plays, calls):
            reply = play.environment.started([next(outcomes) for _ in play_calls])
            play.response.episode.environment = play.environment.instance
            if self.opens_prompt:
                self.end_prompt(play, reply)
            self.count(play.response.episode, reply)
            if reply.error:
                failures.append(reply.error)
        if not self.opens_prompt:  # no class: nothing to start
            return
        if failures:
            self.warn_once("start", f"warning: an episode failed to start: {failures[0]}; it goes "
                           "on without reset's answer, counted in `episode/errors` from now on "
                           "without a message")
        totals = all_reduce({"episodes": len(plays), "failed": len(failures)}, self.device)
        if int(totals["failed"]) == int(totals["episodes"]) > 0:
            first = f", the first: {failures[0]}" if failures else ""  # this rank's
            raise ValueError(f"--rollout.env {self.cfg.env!r}: all {int(totals['episodes'])} "
                             f"episodes of the step failed to start{first}")

    def end_prompt(self, play: Play, reply: Reply) -> None:
        """reset's answer, the end of the prompt's user turn, as the response's beginning; one too
        long to leave a token to generate is left out, a failed start."""
        ids, images = self.render.ending_prompt(reply.messages)
        if self.length(play.response, ids, images) >= self.cfg.max_response_length:
            reply.failed(f"{play.environment.name}.reset's answer is {len(ids):,} tokens with the "
                         "end of the user's turn, which leaves none of "
                         f"--rollout.max-response-length {self.cfg.max_response_length} to "
                         "generate: raise it")
            reply.messages = []
            ids, images = self.render.ending_prompt([])
        self.append_given(play.response, ids, images)
        play.response.episode.messages += reply.messages
        if reply.busy:  # its first turn is generated, and then it ends
            play.response.episode.stop_reason = "errors"

    def first_turns(self, plays: list[Play], prompts: list[dict], n: int,
                    generate: Callable) -> list[Response]:
        """The first turn of every episode: n samples of each prompt in one request where the
        episodes of a prompt begin alike (always, when the prompt is not left open), else a request
        per episode."""
        groups = [plays[i * n:(i + 1) * n] for i in range(len(prompts))]
        if all(p.response.token_ids == group[0].response.token_ids and not p.response.images
               for group in groups for p in group):
            contexts = [self.context(group[0]) for group in groups]
            return [turn for group in generate(contexts, None, [self.left(g[0]) for g in groups])
                    for turn in group]
        return [group[0] for group in generate([self.context(p) for p in plays], 1,
                                               [self.left(p) for p in plays])]

    def add_turn(self, play: Play, turn: Response, number: int) -> list[Call]:
        """Append generated turn `number` to the episode; the calls that answer it (none when its
        environment can answer nothing more)."""
        response, episode = play.response, play.response.episode
        response.token_ids += turn.token_ids
        response.logprobs += turn.logprobs
        response.mask += [1] * len(turn.token_ids)
        response.truncated = turn.truncated
        episode.turns = number
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        final = (number == self.cfg.max_turns
                 or self.length(response) >= self.cfg.max_response_length)
        message, calls = play.environment.turn(text, final, play.item["images"] + response.images)
        episode.messages.append(message)
        if episode.stop_reason:  # ended at its start (its environment could answer nothing more)
            response.truncated = False
            return []
        play.final = final
        return calls

    def add_answer(self, play: Play, reply: Reply) -> None:
        """The environment's reply: the episode ends (its reason), or the answer is appended,
        given."""
        response, episode, cfg = play.response, play.response.episode, self.cfg
        self.count(episode, reply)
        if reply.error:
            self.warn_once("answer", f"warning: {reply.error}; the model reads the error, "
                           "--rollout.max-env-errors of them end the episode, counted in "
                           "`episode/errors` from now on without a message")
        if reply.messages is None:
            episode.stop_reason = "length" if response.truncated else "done"
        elif reply.busy or cfg.max_env_errors and episode.errors >= cfg.max_env_errors:
            episode.stop_reason = "errors"
        elif play.final:
            episode.stop_reason = "max_turns" if episode.turns == cfg.max_turns else "length"
        else:
            ids, images = self.render.after_turn(
                reply.messages, ended=response.token_ids[-1:] == [self.tokenizer.eos_token_id])
            # no room for one more token
            if self.length(response, ids, images) >= cfg.max_response_length:
                episode.stop_reason = "length"
            else:
                self.append_given(response, ids, images)
                episode.messages += reply.messages
        response.truncated = episode.stop_reason == "length"

    def count(self, episode: Episode, reply: Reply) -> None:
        episode.calls += reply.calls
        episode.errors += reply.errors
        episode.seconds += reply.seconds

    def warn_once(self, kind: str, message: str) -> None:
        """The first of a kind of the environment's failures on the console, once over all ranks and
        the run (as a reward's first failure is); the later ones only counted."""
        if kind not in self.warned:
            self.warned.add(kind)
            if first_to_report(f"environment failed: {kind}"):
                print(message, file=sys.stderr, flush=True)

    def append_given(self, response: Response, ids: list[int], images: list) -> None:
        response.token_ids += ids
        response.logprobs += [0.0] * len(ids)
        response.mask += [0] * len(ids)
        response.images += images

    def context(self, play: Play) -> dict:
        """The prompt of the episode's next turn: its prompt and its response so far, with their
        images."""
        return {"prompt_ids": play.item["prompt_ids"] + play.response.token_ids,
                "images": play.item["images"] + play.response.images, "videos": play.item["videos"]}

    def cap(self) -> int:
        return min(self.cfg.max_turn_tokens or self.cfg.max_response_length,
                   self.cfg.max_response_length)

    def left(self, play: Play) -> int:
        """Tokens the episode's next turn may generate: what is left of the budget, at most the turn
        cap."""
        return min(self.cap(), self.cfg.max_response_length - self.length(play.response))

    def length(self, response: Response, ids: list[int] = (), images: list = ()) -> int:
        """The response's length in the engine's tokens (each image counts as the tokens it expands
        into), with `ids` and `images` appended."""
        pictures = [*response.images, *images]
        return (len(response.token_ids) + len(ids)
                + sum(image_tokens(self.processor, i.size) - 1 for i in pictures))


def episode_metrics(responses: list[Response], device: torch.device) -> dict[str, torch.Tensor]:
    """Per-episode means over all ranks: turns, the environment's calls, failed calls, seconds in
    them, the share of response tokens masked out (given, not generated), and the share of each stop
    reason."""
    episodes = [r.episode for r in responses]
    sums = {"count": len(episodes), "turns": sum(e.turns for e in episodes),
            "calls": sum(e.calls for e in episodes), "errors": sum(e.errors for e in episodes),
            "env_seconds": sum(e.seconds for e in episodes),
            "tokens": sum(len(r.mask) for r in responses),
            "masked": sum(r.mask.count(0) for r in responses),
            **{f"stop_{reason}": sum(e.stop_reason == reason for e in episodes)
               for reason in STOP_REASONS}}
    totals = all_reduce(sums, device)
    count = totals.pop("count").clamp(min=1)
    masked = totals.pop("masked") / totals.pop("tokens").clamp(min=1)
    return {"episode/masked_share": masked,
            **{f"episode/{key}": value / count for key, value in totals.items()}}


@dataclass
class Episodes:
    """What plays each sample as a multi-turn episode: the factory of one episode's environment, the
    tools' schemas the prompts list, and whether the prompts leave the user's turn to the
    environment's reset to end."""

    environment: Callable[[], Environment]
    schemas: list[dict]
    opens_prompt: bool


def episodes_of(cfg: RolloutConfig, tool_cfg, processor) -> Episodes | None:
    """The environment --rollout.env names, a class with `respond` (RespondEnvironment) or TRL's
    shape (its public methods tools, beside --tools.functions: tools.ToolEnvironment); or the tool
    functions alone; None: one turn a sample. `tool_cfg`: tools.ToolConfig."""
    cls = environment_class(cfg.env) if cfg.env else None
    functions = load_tools(tool_cfg.functions) if tool_cfg.functions else {}
    max_chars = RESULT_CHARS_PER_TOKEN * cfg.max_response_length
    if cls is not None and hasattr(cls, "respond"):
        if functions:
            raise ValueError(f"--tools.functions with --rollout.env {cfg.env!r}, whose `respond` "
                             "answers every turn: tools are called by an environment without "
                             "respond (TRL's shape); drop one")
        return Episodes(lambda: RespondEnvironment(cls, cfg.env_timeout, max_chars, processor),
                        [], True)
    tools = {**functions, **(methods(cls) if cls is not None else {})}
    if cls is not None and not tools:
        raise ValueError(f"--rollout.env {cfg.env!r}: {cls.__name__} has neither `respond` nor a "
                         "public method the model could call as a tool")
    if not tools:
        return None
    parse = load_parser(tool_cfg.parser)
    return Episodes(lambda: ToolEnvironment(cls, functions, parse, tool_cfg, cfg.env_timeout,
                                            max_chars, processor),
                    [tool_schema(fn) for fn in tools.values()], cls is not None)
