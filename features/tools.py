"""Tools: Python functions the model calls in its turns, and the tool environment that runs
them (one kind of features/env.py's environments).

    # the built-in task: an answer only a lookup tool knows
    torchrun --nproc_per_node 2 grpo.py toy_tools
    # your tools: the public functions of a file
    ... --tools.functions my_tools.py --rollout.max-turns 4
    # a TRL environment class: its public methods are tools
    ... --rollout.env my_env.py:Env --reward.function env

A turn that calls a tool, in Qwen's format (`|` marks where the model's own tokens end and the given
ones begin):
    prompt
    | <tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call><|im_end|>
    | \\n<|im_start|>user\\n<tool_response>\\n42\\n</tool_response><|im_end|>
      \\n<|im_start|>assistant\\n
    | The answer is 42.<|im_end|>
The episode (turn after turn, token in and token out, the mask, the budget, calls at once, ranks in
lockstep) is features/episodes.py's; this file is what is particular to tools: the calls a turn
makes, and their results as the next turn. The built-in tools are tasks' (`--tools.functions NAME`:
the `tools` of tasks/NAME.py or tasks/NAME_tools.py: toy, calculator).

Design decisions:
- A tool is a typed Python function with a Google-style docstring, or a public method of an
  environment class (TRL's `environment_factory` shape, bound to the episode's instance); its JSON
  schema (transformers' `get_json_schema`; a parameter's description may be left out, as a tool
  schema allows) goes to the chat template as `tools`, so the prompt lists the tools as the model's
  own template would. Parameters named `row` (the dataset row) and `images` (the episode's images so
  far: the prompt's, then the environment's) are filled in by the loop and kept out of the schema: a
  lookup keyed by the row, a crop of the input image.
- The parser is one function from a turn's text to its calls (load_parser; Qwen's `<tool_call>`
  JSON by default, a task's `parser` by its name). A call records its source text, which the turn's
  message leaves out of its content: the episode's messages hold each call once, in `tool_calls`,
  so that rendering them again (for a judge, a reward, a log) shows it once.
- Tools fail safely: a call that raises (sys.exit too; os._exit and os.fork raise:
  plumbing/calls.py), runs past --tools.timeout, names no tool, has arguments the function does not
  take, or returns something other than text or an image the model can read, and a turn the parser
  cannot read, get an error message as the result, counted in `episode/errors`;
  --rollout.max-env-errors of them end the episode. A tool gets copies of the row and the images;
  its text is cut at env.RESULT_CHARS_PER_TOKEN characters a token of the budget before it is
  rendered, and so is the text of all a turn's results together (env.cut_answer). A tool stuck in C
  code that holds the GIL stalls the rank regardless (the built-in calculator refuses powers of over
  300 digits for this); one that must be killed (untrusted code) runs its work in a subprocess of
  its own.
"""

import copy
import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from PIL import Image

from features.env import Environment, Reply, check_images, content, cut, cut_answer
from plumbing.calls import Call, Outcome
from plumbing.loading import load_function, load_module, task_piece, tasks_with

INJECTED = ("row", "images")  # tool parameters the loop fills in; the model never sees them


@dataclass
class ToolConfig:
    functions: str = ""
    """Tools the model may call, turn after turn: a Python file or module whose public functions (or
    TOOLS list) are the tools, or a built-in task's (toy, calculator: tasks/); empty: none (an
    environment class's public methods are tools too: --rollout.env)."""
    parser: str = "qwen"
    """How a turn's text calls tools: qwen (`<tool_call>` JSON), toy (a turn not led by a digit
    calls lookup: tasks/toy_tools.py), or path/to/file.py:function."""
    timeout: float = 5.0
    """Seconds a tool call may run before the model is told it timed out (0: no limit)."""


@dataclass
class ToolCall:
    name: str
    arguments: dict
    # a call the parser could not read: why (the model is told, and it counts as a failed call)
    error: str = ""
    # the call as written in the turn, left out of the turn's message
    source: str = field(default="", compare=False)


# --------------------------------------------------------------------------------------------------
# Parsers: a turn's text -> its tool calls
# --------------------------------------------------------------------------------------------------


def parse_qwen(text: str) -> list[ToolCall]:
    """Qwen's (and Hermes') format: each call a JSON object with a name and arguments in
    `<tool_call>` tags; a call without `arguments` is not read (vLLM's parser serves it as no call
    at all), and is a failed call here.

    '<tool_call>\\n{"name": "lookup", "arguments": {"key": "a"}}\\n</tool_call>'
    -> [ToolCall("lookup", {"key": "a"})]
    """
    calls = []
    for match in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        body, source = match.group(1), match.group(0)
        try:
            call = json.loads(body)
        # not JSON, and a degenerate turn: 2,000 `[`, a 5,000-digit number
        except (ValueError, RecursionError) as error:
            reason = error.msg if isinstance(error, json.JSONDecodeError) else f"{error}"[:80]
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({reason}): "
                                  f"{body.strip()[:80]}", source))
            continue
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
                or not isinstance(arguments, dict)):
            calls.append(ToolCall("", {}, 'a tool call is {"name": <function-name>, '
                                  '"arguments": <args-json-object>}'
                                  f", got {body.strip()[:80]}", source))
            continue
        calls.append(ToolCall(call["name"], arguments, source=source))
    return calls


def load_parser(spec: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name: qwen, or a built-in task's (NAME: the `parser` of tasks/NAME.py or
    tasks/NAME_tools.py); or `path/to/file.py:function` (text -> list[ToolCall])."""
    parser = parse_qwen if spec == "qwen" else task_piece(spec, "parser", "tools")
    if parser is not None:
        return parser
    return load_function(spec, "tool_parser", "--tools.parser",
                         f"a built-in ({', '.join(['qwen', *tasks_with('parser', 'tools')])})")


# --------------------------------------------------------------------------------------------------
# Tools: loading, schemas, calls
# --------------------------------------------------------------------------------------------------


def load_tools(spec: str) -> dict[str, Callable]:
    """The tools `spec` names, by name: a built-in task's (NAME: the `tools` list of tasks/NAME.py
    or tasks/NAME_tools.py), or a Python file or module whose TOOLS list (if it has one) or public
    functions defined in it are the tools."""
    functions = task_piece(spec, "tools", "tools")
    if functions is None:
        module = load_module(spec, "tools", "--tools.functions",
                             f"a built-in ({', '.join(tasks_with('tools', 'tools'))})")
        functions = module.TOOLS if hasattr(module, "TOOLS") else [
            value for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__
            and not name.startswith("_")]
        if (not isinstance(functions, (list, tuple))
                or not all(inspect.isfunction(fn) for fn in functions)):
            raise ValueError(f"--tools.functions {spec!r}: TOOLS must be a list of functions, "
                             f"got {functions!r:.80}")
    if not functions:
        raise ValueError(f"--tools.functions {spec!r} defines no function: write "
                         "`def my_tool(x: int) -> str:` there")
    return {fn.__name__: fn for fn in functions}


def methods(obj) -> dict[str, Callable]:
    """The tools of an environment class or instance, TRL's way: its public methods but reset and
    get_reward (bound to the instance)."""
    cls = obj if inspect.isclass(obj) else type(obj)
    return {name: getattr(obj, name) for name, _ in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")}


def tool_schema(fn: Callable) -> dict:
    """The JSON schema the chat template shows the model: transformers' get_json_schema of the
    function (a method's without `self`) without its INJECTED parameters. A parameter the docstring
    does not describe under `Args:` gets no description (transformers refuses it; a schema's
    descriptions are optional)."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    signature = inspect.signature(fn)
    if list(signature.parameters)[:1] == ["self"]:  # a method of a class, not of an instance
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    shown_parameters = [p for p in signature.parameters.values() if p.name not in INJECTED]
    described, undescribed = "", []
    description, arguments, returns = parse_google_format_docstring(inspect.getdoc(fn) or "")
    for parameter in shown_parameters:
        if not (arguments or {}).get(parameter.name):
            undescribed.append(parameter.name)
        described += f"\n    {parameter.name}: {(arguments or {}).get(parameter.name) or '-'}"

    @functools.wraps(fn)
    def shown(*args, **kwargs):
        return fn(*args, **kwargs)

    shown.__signature__ = signature.replace(parameters=shown_parameters)
    shown.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k not in INJECTED}
    shown.__doc__ = (description or "") + (f"\n\nArgs:{described}" if described else "") + \
        (f"\n\nReturns:\n    {returns}" if returns else "")
    try:
        schema = get_json_schema(shown)
    except Exception as error:
        raise ValueError(f"tool {fn.__name__!r} ({inspect.getsourcefile(fn)}): {error}. A tool "
                         "is a function with a type hint on every parameter and a Google-style "
                         "docstring (its arguments described under `Args:`, each optionally)"
                         ) from None
    for name in undescribed:
        schema["function"]["parameters"]["properties"][name].pop("description")
    return schema


@dataclass
class ToolResult:
    content: list  # the tool message's parts: text and PIL images
    error: str = ""  # why the call failed (then `content` is that message)


def call_tool(tools: dict[str, Callable], call: ToolCall, row: dict, images: list, processor=None,
              max_chars: int = 0) -> ToolResult:
    """One call, whatever it does: its result, or an error message the model reads in the tool turn.
    The tool gets copies of the row and the images (what it changes stays its own). `processor`: the
    model's (None: it reads text only, so an image is an error; else an image must be one it takes).
    Text past `max_chars` is cut (0: none).
    """
    def failed(error: str) -> ToolResult:
        return ToolResult([f"error: {error}"], error)

    if call.error:
        return failed(call.error)
    fn = tools.get(call.name)
    if fn is None:
        return failed(f"no tool named {call.name!r}; the tools are {', '.join(tools)}")
    signature = inspect.signature(fn)
    parameters = signature.parameters
    if set(call.arguments) & set(INJECTED):
        return failed(f"{call.name} takes no argument "
                      f"{sorted(set(call.arguments) & set(INJECTED))}")
    try:
        signature.bind(**call.arguments, **dict.fromkeys(set(INJECTED) & set(parameters)))
    except TypeError as error:
        return failed(f"bad arguments for {call.name}: {error}")
    context = {k: copy.deepcopy(v) if k == "row" else [image.copy() for image in v]
               for k, v in (("row", row), ("images", images)) if k in parameters}
    try:
        value = fn(**call.arguments, **context)
    # SystemExit and KeyboardInterrupt too: raised by the tool, in its thread
    except BaseException as error:
        return failed(f"{call.name} raised {type(error).__name__}: {error}")
    parts = value if isinstance(value, list) else [value]
    if not parts or not all(isinstance(part, (str, Image.Image)) for part in parts):
        return failed(f"{call.name} returned {type(value).__name__} {value!r:.60}; a tool returns "
                      "text, an image, or a list of them")
    try:
        check_images(parts, processor)
    except ValueError as problem:
        return failed(f"{call.name} {problem}")
    return ToolResult(cut(parts, max_chars))


# --------------------------------------------------------------------------------------------------
# The tool environment
# --------------------------------------------------------------------------------------------------


class ToolEnvironment(Environment):
    """Tools as an episode's environment: a turn's calls, read by the parser, run at once (each
    within --tools.timeout), and their results are the next turn, a tool message each; a turn that
    calls no tool ends the episode. The tools: `functions`, and the public methods of the episode's
    instance of an environment class `cls` (TRL's shape; None: the functions alone), whose reset
    starts the episode."""

    def __init__(self, cls, functions: dict[str, Callable], parse: Callable[[str], list[ToolCall]],
                 cfg: ToolConfig, env_timeout: float, max_chars: int, processor=None):
        super().__init__(cls, env_timeout, max_chars, processor)
        self.functions, self.parse, self.cfg = functions, parse, cfg
        self.calls: list[ToolCall] = []  # the last turn's

    def turn(self, text: str, final: bool, images: list) -> tuple[dict, list[Call]]:
        self.calls = self.read(text)
        message = {"role": "assistant", "content": text, "tool_calls": [
            {"name": call.name, "arguments": call.arguments}
            for call in self.calls if not call.error]}
        for call in self.calls:  # each call once: in tool_calls, not in the text too
            if call.source and not call.error:
                message["content"] = message["content"].replace(call.source, "", 1).strip()
        if final:  # no one would read the results
            return message, []
        tools = {**self.functions, **(methods(self.instance) if self.instance is not None else {})}
        return message, [Call(call.name or "parse",
                              functools.partial(call_tool, tools, call, self.row, images,
                                                self.processor, self.max_chars),
                              self.cfg.timeout) for call in self.calls]

    def answered(self, outcomes: list[Outcome]) -> Reply:
        if not self.calls:
            return Reply(None)
        reply = Reply([], calls=len(outcomes), seconds=sum(o.seconds for o in outcomes))
        for call, outcome in zip(self.calls, outcomes):
            result = (outcome.value if not outcome.error
                      else ToolResult([f"error: {outcome.error}"], outcome.error))
            reply.messages.append({"role": "tool", "name": call.name, "content": result.content})
            reply.errors += bool(result.error)
            reply.busy |= (outcome.timed_out and self.instance is not None
                           and call.name in methods(self.instance))
        reply.messages = [{**m, "content": content(m["content"])}
                          for m in cut_answer(reply.messages, self.max_chars)]
        return reply

    def read(self, text: str) -> list[ToolCall]:
        """The turn's calls as --tools.parser reads them; a parser that raises on the turn (a
        degenerate one: deep brackets, a huge number) gives one failed call the model is told of."""
        try:
            calls = self.parse(text)
        except Exception as error:
            return [ToolCall("", {}, f"the turn's tool calls could not be read: "
                                     f"{type(error).__name__}: {error}"[:200])]
        if not isinstance(calls, list) or not all(isinstance(call, ToolCall) for call in calls):
            raise ValueError(f"--tools.parser {self.cfg.parser!r} returned {calls!r:.80}; a parser "
                             "returns a list of tools.ToolCall (empty: the turn calls no tool)")
        return calls
