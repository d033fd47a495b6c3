"""Multi-turn episodes with tool calls: the model calls Python functions and reads their results, turn after turn.

    torchrun --nproc_per_node 2 grpo.py toy_tools            # the built-in task: an answer only a lookup tool knows
    ... --rollout.tools my_tools.py --rollout.max-turns 4    # your tools: the public functions of a file

An episode in tokens, Qwen's format (`|` marks where the model's own tokens end and the given ones begin):
    prompt | <tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call><|im_end|>
           | \\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
           | The answer is 42.<|im_end|>
The trainer's response is everything after the prompt: the tool turns are in it (the model reads them) but masked
out of every loss, KL and metric (logprobs.Batch's holed response mask); the reward goes on the last generated token.

Design decisions:
- Token in, token out: the engine's own ids of every generated turn are kept, and only the new tool turn (rendered
  on its own by the chat template, with the next assistant header) is tokenized and appended. Nothing generated is
  ever re-tokenized: decoding a sampled turn and encoding it again need not give its tokens back (a sample may
  split a word as the tokenizer never would: tests/test_real_tokenizer.py), and the trainer would then score a
  sequence the engine never sampled. Each turn's prompt is the previous turn's prompt, the ids it generated and
  the tool turn, so vLLM's prefix cache serves the re-prefill.
- A tool is a typed Python function with a Google-style docstring; its JSON schema (transformers'
  `get_json_schema`) goes to the chat template as `tools`, so the prompt lists the tools as the model's own
  template would. Parameters named `row` (the dataset row) and `images` (the episode's images so far: the
  prompt's, then the tools') are filled in by the loop and kept out of the schema: a lookup keyed by the row,
  a crop of the input image.
- The parser is one function from a turn's text to its calls (PARSERS; Qwen's `<tool_call>` JSON by default).
- Tools fail safely: a call that raises (sys.exit too), runs past --rollout.tool-timeout, names no tool, has
  arguments the function does not take, or returns something other than text or an image the model can read, and a
  turn the parser cannot read, get an error message as the result and are counted; --rollout.max-tool-errors of
  them end the episode. A tool gets copies of the row and the images; its text is cut at RESULT_CHARS_PER_TOKEN
  characters a token of the budget before it is rendered, and tokenized as plain text (control tokens in it are
  characters the model reads).
- All calls of a turn, over all the episodes of the rank, run at once, each in a daemon thread, and the turn
  waits at most the timeout. A call past its time is abandoned, not stopped (Python cannot kill a thread): it
  runs on in the background and its result is dropped; a tool with STRAY_CALLS of them is refused until they end.
  A call stuck in C code that holds the GIL stalls the rank regardless (the built-in calculator refuses powers of
  over 300 digits for this). A tool that must be killed (untrusted code) runs its work in a subprocess of its own.
- Ranks take turns in lockstep: a turn is a collective for the hf engine (it gathers the FSDP2 weights) and for
  tensor-parallel vLLM, so a rank whose episodes are over joins the others' turns with nothing to generate.
- The whole episode fits --rollout.max-response-length tokens, generated and given (an image counts as its
  tokens); each turn may generate what is left, at most --rollout.max-turn-tokens. A tool turn that does not
  fit ends the episode (stop reason `length`) without being added.
"""

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import math
import operator
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from plumbing.collectives import all_reduce
from plumbing.console import first_to_report
from rollout import Response, RolloutConfig
from vision import image_tokens

INJECTED = ("row", "images")  # tool parameters the loop fills in; the model never sees them
STOP_REASONS = ("answered", "max_turns", "length", "tool_errors")


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # a call the parser could not read: why (the model is told, and it counts as a tool error)


@dataclass
class Episode:
    """What happened in one sampled episode: the reward function reads `messages`, the metrics the counts."""

    messages: list[dict] = field(default_factory=list)
    """The turns after the prompt, as the model read them: {"role": "assistant", "content": text, "tool_calls":
    [{"name", "arguments"}]}, {"role": "tool", "name": ..., "content": text or [parts]}, in order."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0  # summed over the calls (they overlap in time)
    stop_reason: str = ""  # one of STOP_REASONS


# ---------------------------------------------------------------------------------------------------
# Parsers: a turn's text -> its tool calls
# ---------------------------------------------------------------------------------------------------


def parse_qwen(text: str) -> list[ToolCall]:
    """Qwen's (and Hermes') format: each call a JSON object in `<tool_call>` tags.

    '<tool_call>\\n{"name": "lookup", "arguments": {"key": "a"}}\\n</tool_call>' -> [ToolCall("lookup", {"key": "a"})]
    """
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as error:  # and a degenerate turn: 2,000 `[`, a 5,000-digit number
            reason = error.msg if isinstance(error, json.JSONDecodeError) else f"{error}"[:80]
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({reason}): {body.strip()[:80]}"))
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'a tool call is {"name": <function-name>, "arguments": <args-json-object>}'
                                  f", got {body.strip()[:80]}"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def parse_toy(text: str) -> list[ToolCall]:
    """The built-in task's call syntax, which a random model hits from the start: a turn that does not begin with a
    digit (the answer) looks the answer up.

    'ab' -> [ToolCall("lookup", {})]; ' 7' -> [] (an answer)
    """
    return [] if text.strip()[:1].isdigit() else [ToolCall("lookup", {})]


PARSERS = {"qwen": parse_qwen, "toy": parse_toy}


# ---------------------------------------------------------------------------------------------------
# Built-in tools
# ---------------------------------------------------------------------------------------------------


def lookup(row: dict) -> str:
    """Look up the value this question asks for in the hidden table."""
    return str(row["answer"])


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(3 + 4) * 12 / 7"
    """
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1 and
                                                 right * math.log10(abs(left)) > 300):
                raise ValueError("too large: a power of over 300 digits, or an exponent over 100")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(round(result, 10) if isinstance(result, float) else result)


BUILTIN_TOOLS = {"toy": [lookup], "calculator": [calculate]}


# ---------------------------------------------------------------------------------------------------
# Tools: loading, schemas, calls
# ---------------------------------------------------------------------------------------------------


def load_tools(spec: str) -> dict[str, Callable]:
    """The tools `spec` names, by name: a built-in set (BUILTIN_TOOLS), or a Python file or module whose TOOLS list
    (if it has one) or public functions defined in it are the tools."""
    if spec in BUILTIN_TOOLS:
        functions = BUILTIN_TOOLS[spec]
    else:
        if spec.endswith(".py"):
            if not Path(spec).is_file():
                raise ValueError(f"--rollout.tools {spec!r}: no such file (cwd: {Path.cwd()})")
            module = _module_from_file(spec, "tools", "--rollout.tools")
        else:
            try:
                module = importlib.import_module(spec)
            except ImportError as error:
                raise ValueError(f"--rollout.tools {spec!r}: not a built-in ({', '.join(BUILTIN_TOOLS)}), a .py file "
                                 f"or an importable module ({error})") from None
        functions = module.TOOLS if hasattr(module, "TOOLS") else [
            value for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")]
        if not isinstance(functions, (list, tuple)) or not all(inspect.isfunction(fn) for fn in functions):
            raise ValueError(f"--rollout.tools {spec!r}: TOOLS must be a list of functions, got {functions!r:.80}")
    if not functions:
        raise ValueError(f"--rollout.tools {spec!r} defines no function: write `def my_tool(x: int) -> str:` there")
    return {fn.__name__: fn for fn in functions}


def _module_from_file(path: str, prefix: str, flag: str):
    """The Python file at `path`, imported as the module `PREFIX_STEM`; an error in it is one line naming `flag`."""
    module_spec = importlib.util.spec_from_file_location(f"{prefix}_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as importlib's recipe: pickle and dataclasses look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        line = next((f", line {frame.lineno}" for frame in reversed(traceback.extract_tb(error.__traceback__))
                     if frame.filename == str(Path(path).resolve()) or frame.filename == path), "")
        raise ValueError(f"{flag} {path!r}: importing it raised {type(error).__name__}{line}: {error}") from None
    return module


def tool_schema(fn: Callable) -> dict:
    """The JSON schema the chat template shows the model: transformers' get_json_schema of the function without
    its INJECTED parameters (the docstring must describe every other parameter under `Args:`)."""
    from transformers.utils import get_json_schema

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def shown(*args, **kwargs):
        return fn(*args, **kwargs)

    shown.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values()
                                                        if p.name not in INJECTED])
    shown.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k not in INJECTED}
    try:
        return get_json_schema(shown)
    except Exception as error:
        raise ValueError(f"tool {fn.__name__!r} ({inspect.getsourcefile(fn)}): {error}. A tool is a function with a "
                         "type hint on every parameter and a Google-style docstring that describes each under `Args:`"
                         ) from None


@dataclass
class ToolResult:
    content: list  # the tool turn's parts: text and PIL images
    error: str = ""  # why the call failed (then `content` is that message)
    seconds: float = 0.0


def call_tool(tools: dict[str, Callable], call: ToolCall, row: dict, images: list, processor=None,
              max_chars: int = 0) -> ToolResult:
    """One call, whatever it does: its result, or an error message the model reads in the tool turn. The tool gets
    copies of the row and the images (what it changes stays its own). `processor`: the model's (None: it reads
    text only, so an image is an error; else an image must be one it takes). Text past `max_chars` is cut (0: none).
    """
    start = time.perf_counter()

    def failed(error: str) -> ToolResult:
        return ToolResult([f"error: {error}"], error, time.perf_counter() - start)

    if call.error:
        return failed(call.error)
    fn = tools.get(call.name)
    if fn is None:
        return failed(f"no tool named {call.name!r}; the tools are {', '.join(tools)}")
    signature = inspect.signature(fn)
    parameters = signature.parameters
    if set(call.arguments) & set(INJECTED):
        return failed(f"{call.name} takes no argument {sorted(set(call.arguments) & set(INJECTED))}")
    try:
        signature.bind(**call.arguments, **dict.fromkeys(set(INJECTED) & set(parameters)))
    except TypeError as error:
        return failed(f"bad arguments for {call.name}: {error}")
    context = {k: copy.deepcopy(v) if k == "row" else [image.copy() for image in v]
               for k, v in (("row", row), ("images", images)) if k in parameters}
    try:
        value = fn(**call.arguments, **context)
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: raised by the tool, in its thread
        return failed(f"{call.name} raised {type(error).__name__}: {error}")
    parts = value if isinstance(value, list) else [value]
    if not parts or not all(isinstance(part, (str, Image.Image)) for part in parts):
        return failed(f"{call.name} returned {type(value).__name__} {value!r:.60}; a tool returns text, an image, or a "
                      "list of them")
    for image in (part for part in parts if isinstance(part, Image.Image)):
        if processor is None:
            return failed(f"{call.name} returned an image, but the model reads text only")
        try:
            image_tokens(processor, image.size)
        except ValueError as error:  # Qwen-VL: an aspect ratio of 200 or more
            return failed(f"{call.name} returned an image of {image.width} x {image.height} pixels, which the model "
                          f"cannot read: {error}")
    return ToolResult(cut(parts, max_chars), seconds=time.perf_counter() - start)


def cut(parts: list, max_chars: int) -> list:
    """The parts with their text cut to `max_chars` characters in all (0: as they are), the cut said where it is:
    (["abcdef", "gh"], 4) -> ["abcd [... 4 more characters]"]."""
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


RESULT_CHARS_PER_TOKEN = 8  # a tool turn's text is cut at this many characters per token of the episode's budget
STRAY_CALLS = 64  # a tool's calls still running past their time limit; more and its next calls are refused
_strays: dict[str, list[threading.Thread]] = {}  # per tool: its abandoned calls, until they end


def run_calls(tools: dict[str, Callable], calls: list[tuple[ToolCall, dict, list]], timeout: float, processor=None,
              max_chars: int = 0) -> list[ToolResult]:
    """Every (call, row, images) at once, one daemon thread each (call_tool's `processor` and `max_chars`); a call
    still running after `timeout` seconds (0: no limit) gets a timeout error and is left to finish in the
    background. A tool with STRAY_CALLS such calls still running is not called until they end (an error instead),
    so a tool that hangs holds a bounded number of threads."""
    results: list[ToolResult | None] = [None] * len(calls)
    for threads in _strays.values():
        threads[:] = [thread for thread in threads if thread.is_alive()]

    def work(i: int, call: ToolCall, row: dict, images: list) -> None:
        results[i] = call_tool(tools, call, row, images, processor, max_chars)

    threads = {}
    for i, (call, row, images) in enumerate(calls):
        if len(_strays.get(call.name, ())) >= STRAY_CALLS:
            results[i] = ToolResult([f"error: {call.name} was not called: {STRAY_CALLS} earlier calls of it are still "
                                     "running past their time limit"], "refused: earlier calls still running")
        else:
            threads[i] = threading.Thread(target=work, args=(i, call, row, images), daemon=True, name=f"tool-{i}")
    deadline = time.monotonic() + timeout
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()) if timeout else None)
    done = list(results)  # a call that finishes from now on changes nothing
    for i, thread in threads.items():
        if done[i] is None:
            _strays.setdefault(calls[i][0].name, []).append(thread)
    return [result if result is not None else
            ToolResult([f"error: {call.name} ran past the time limit of {timeout:g} s"],
                       f"timed out after {timeout:g} s", timeout)
            for result, (call, _, _) in zip(done, calls)]


# ---------------------------------------------------------------------------------------------------
# The episode loop
# ---------------------------------------------------------------------------------------------------


class ToolRollout:
    """A rollout engine (rollout.py) whose `generate` plays whole episodes: generate a turn, run its tool calls,
    append the tool turn, generate again, until the model answers without a call, --rollout.max-turns turns, the
    token budget, or --rollout.max-tool-errors failed calls. The engine's contract: one list of n Responses per
    prompt, here each with its `mask` (0 on the tool turns), its `images` (the tools') and its `episode`.
    Weight syncs, sleep and shutdown are the engine's own.
    """

    def __init__(self, engine, cfg: RolloutConfig, tools: dict[str, Callable], tokenizer, processor,
                 device: torch.device):
        self.engine, self.cfg, self.tools, self.device = engine, cfg, tools, device
        self.tokenizer, self.processor = tokenizer, processor
        self.schemas = [tool_schema(fn) for fn in tools.values()]
        self.parse = load_parser(cfg.tool_parser)
        # the chat template's text after an assistant turn's end token, before the next turn (Qwen's: a newline)
        self.head = self._render(CONVERSATION, generation_prompt=False)
        end = tokenizer.eos_token
        if end not in self.head:
            raise ValueError(f"the chat template does not close an assistant turn with the end token {end!r}; a "
                             "multi-turn rollout needs it to tell where a turn ends")
        self.after_end = self.head[self.head.rindex(end) + len(end):]
        if self.schemas and self._render(CONVERSATION[:1], True) == self._render(CONVERSATION[:1], True, tools=False) \
                and first_to_report("template ignores tools"):
            print(f"warning: the chat template ignores `tools`, so the model is not shown the tools "
                  f"({', '.join(tools)}) and knows them only from the prompt", file=sys.stderr, flush=True)
        self.max_chars = RESULT_CHARS_PER_TOKEN * cfg.max_response_length

    def __getattr__(self, name: str):  # weights_version, sync_weights, sleep, shutdown: the engine's
        return getattr(self.engine, name)

    def generate(self, prompts: list[dict], version: int, validation: bool = False,
                 greedy: bool = False) -> list[list[Response]]:
        """Episodes for `prompts` (dataset items: prompt_ids, images, videos, row): n per prompt, as the engine
        samples."""
        cfg, budget = self.cfg, self.cfg.max_response_length
        cap = min(cfg.max_turn_tokens or budget, budget)
        sampled = self.engine.generate(prompts, version, validation, greedy, max_tokens=[cap] * len(prompts))
        groups = [[Response([], [], False, mask=[], episode=Episode()) for _ in group] for group in sampled]
        live = [(item, response) for item, group in zip(prompts, groups) for response in group]
        turns = [turn for group in sampled for turn in group]
        for number in range(1, cfg.max_turns + 1):
            waiting = []  # (item, response, whether the turn ended with the template's end token, its calls)
            for (item, response), turn in zip(live, turns):
                calls = self._add_turn(response, turn, number)
                if calls:
                    waiting.append((item, response, turn.token_ids[-1:] == [self.tokenizer.eos_token_id], calls))
            jobs = [(call, item["row"], item["images"] + response.images) for item, response, _, calls in waiting
                    for call in calls]
            results = iter(run_calls(self.tools, jobs, cfg.tool_timeout, self.processor, self.max_chars))
            live = [(item, response) for item, response, ended, calls in waiting
                    if self._add_tool_turn(response, [(call, next(results)) for call in calls], ended)]
            if all_reduce({"live": len(live)}, self.device, torch.distributed.ReduceOp.MAX)["live"] == 0:
                break  # every rank stops at once: for some engines a turn is a collective
            contexts = [{"prompt_ids": item["prompt_ids"] + response.token_ids,
                         "images": item["images"] + response.images, "videos": item["videos"]}
                        for item, response in live]
            left = [min(cap, budget - self._length(response)) for _, response in live]
            turns = [group[0] for group in self.engine.generate(contexts, version, validation, greedy, n=1,
                                                                max_tokens=left)]
        return groups

    def _add_turn(self, response: Response, turn: Response, number: int) -> list[ToolCall]:
        """Append generated turn `number` to the episode; its tool calls to run, or [] when the episode ends here."""
        response.token_ids += turn.token_ids
        response.logprobs += turn.logprobs
        response.mask += [1] * len(turn.token_ids)
        episode = response.episode
        episode.turns = number
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        calls = self._parse(text)
        episode.messages.append({"role": "assistant", "content": text, "tool_calls": [
            {"name": call.name, "arguments": call.arguments} for call in calls if not call.error]})
        if not calls:
            episode.stop_reason = "length" if turn.truncated else "answered"
        elif number == self.cfg.max_turns:
            episode.stop_reason = "max_turns"
        elif self._length(response) >= self.cfg.max_response_length:
            episode.stop_reason = "length"
        response.truncated = episode.stop_reason == "length"
        return [] if episode.stop_reason else calls

    def _add_tool_turn(self, response: Response, outcomes: list[tuple[ToolCall, ToolResult]], ended: bool) -> bool:
        """Record the calls and their results, and append the tool turn to the episode, after the template's end
        token when the turn did not end with it (cut short, or ended by another end token: Qwen's `<|endoftext|>`);
        False when the episode ends instead: too many failed calls, or no room for the tool turn and one more
        generated token."""
        episode = response.episode
        messages = [{"role": "tool", "name": call.name, "content": tool_content(result.content)}
                    for call, result in outcomes]
        episode.tool_calls += len(outcomes)
        episode.tool_errors += sum(bool(result.error) for _, result in outcomes)
        episode.tool_seconds += sum(result.seconds for _, result in outcomes)
        if self.cfg.max_tool_errors and episode.tool_errors >= self.cfg.max_tool_errors:
            episode.stop_reason = "tool_errors"
            return False
        ids = self._tool_turn_ids([result.content for _, result in outcomes], [call.name for call, _ in outcomes],
                                  ended)
        images = [part for _, result in outcomes for part in result.content if isinstance(part, Image.Image)]
        if self._length(response) + len(ids) + sum(image_tokens(self.processor, i.size) - 1 for i in images) \
                >= self.cfg.max_response_length:
            episode.stop_reason = "length"
            response.truncated = True
            return False
        episode.messages += messages  # what the model reads (a tool turn that ends the episode is not read)
        response.token_ids += ids
        response.logprobs += [0.0] * len(ids)
        response.mask += [0] * len(ids)
        response.images += images
        return True

    def _parse(self, text: str) -> list[ToolCall]:
        """The turn's calls as --rollout.tool-parser reads them; a parser that raises on the turn (a degenerate
        one: deep brackets, a huge number) gives one failed call the model is told of."""
        try:
            calls = self.parse(text)
        except Exception as error:
            return [ToolCall("", {}, f"the turn's tool calls could not be read: {type(error).__name__}: {error}"[:200])]
        if not isinstance(calls, list) or not all(isinstance(call, ToolCall) for call in calls):
            raise ValueError(f"--rollout.tool-parser {self.cfg.tool_parser!r} returned {calls!r:.80}; a parser returns "
                             "a list of tools.ToolCall (empty: the turn calls no tool)")
        return calls

    def _tool_turn_ids(self, contents: list[list], names: list[str], ended: bool) -> list[int]:
        """The ids of the tool turn that shows `contents` (each call's parts), after the template's end token when
        the generated turn did not end with it. A result's text is tokenized as plain text: a control token's text
        in it (`<|im_end|>`) is characters the model reads, not the end of the tool turn."""
        texts = [part for parts in contents for part in parts if isinstance(part, str)]
        marks = iter(range(len(texts)))
        messages = [{"role": "tool", "name": name, "content": tool_content(
            [f"\ue000{next(marks)}\ue001" if isinstance(part, str) else part for part in parts])}
            for name, parts in zip(names, contents)]
        text = self._render(CONVERSATION + messages, generation_prompt=True)
        if not text.startswith(self.head):
            raise ValueError("the chat template renders the start of a conversation differently once a tool turn "
                             "follows, so a tool turn cannot be rendered on its own")
        pieces = re.split("\ue000(\\d+)\ue001", ("" if ended else self.tokenizer.eos_token) + self.after_end +
                          text[len(self.head):])
        if pieces[1::2] != [str(i) for i in range(len(texts))]:
            raise ValueError("the chat template does not show a tool's result once, as given, in the tool turn")
        ids = []
        for i, piece in enumerate(pieces):
            plain = i % 2 == 1
            ids += self.tokenizer(texts[int(piece)] if plain else piece, add_special_tokens=False,
                                  split_special_tokens=plain)["input_ids"]
        return ids

    def _length(self, response: Response) -> int:
        """The response's length in the engine's tokens: each image counts as the tokens it expands into."""
        return len(response.token_ids) + sum(image_tokens(self.processor, image.size) - 1 for image in response.images)

    def _render(self, messages: list[dict], generation_prompt: bool, tools: bool = True) -> str:
        renderer = self.processor if self.processor is not None else self.tokenizer
        return renderer.apply_chat_template(messages, tools=self.schemas if tools and self.schemas else None,
                                            add_generation_prompt=generation_prompt, tokenize=False)


CONVERSATION = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]  # what a tool turn follows


def tool_content(parts: list) -> str | list[dict]:
    """A tool turn's content: its text, or (with an image) a list of parts the chat template renders in order."""
    if all(isinstance(part, str) for part in parts):
        return "\n".join(parts)
    return [{"type": "image", "image": part} if isinstance(part, Image.Image) else {"type": "text", "text": part}
            for part in parts]


def load_parser(spec: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name (PARSERS) or `path/to/file.py:function` (text -> list[ToolCall])."""
    if spec in PARSERS:
        return PARSERS[spec]
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not Path(path).is_file():
        raise ValueError(f"--rollout.tool-parser {spec!r}: use a built-in ({', '.join(PARSERS)}) or "
                         "path/to/file.py:function")
    module = _module_from_file(path, "tool_parser", "--rollout.tool-parser")
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--rollout.tool-parser {spec!r}: {path} has no function {name!r}")
    return getattr(module, name)


def episode_metrics(responses: list[Response], device: torch.device) -> dict[str, torch.Tensor]:
    """Per-episode means over all ranks: turns, tool calls, failed calls, seconds in tools, the share of response
    tokens masked out (given, not generated), and the share of each stop reason."""
    episodes = [r.episode for r in responses]
    sums = {"count": len(episodes), "turns": sum(e.turns for e in episodes),
            "tool_calls": sum(e.tool_calls for e in episodes), "tool_errors": sum(e.tool_errors for e in episodes),
            "tool_seconds": sum(e.tool_seconds for e in episodes),
            "tokens": sum(len(r.mask) for r in responses), "masked": sum(r.mask.count(0) for r in responses),
            **{f"stop_{reason}": sum(e.stop_reason == reason for e in episodes) for reason in STOP_REASONS}}
    totals = all_reduce(sums, device)
    count = totals.pop("count").clamp(min=1)
    masked = totals.pop("masked") / totals.pop("tokens").clamp(min=1)
    return {"episode/masked_share": masked, **{f"episode/{key}": value / count for key, value in totals.items()}}
