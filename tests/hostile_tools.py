"""Tools and a tool-call parser that do what a tool or a model's turn can do wrong, for a run of the toy tool task
(tests/test_episodes.py: `--tools.functions tests/hostile_tools.py --tools.parser
tests/hostile_tools.py:parse`). Each turn, in turn, is one of TURNS: a tool that hangs (many calls at once), one
that returns 20 MB of text, a 30000 x 2 image, sys.exit or KeyboardInterrupt, a degenerate turn (2,000 `[`, a
5,000-digit number) read by Qwen's parser, a parser that raises. The run must go on, every one of them a failed
call the model reads. The parser trips the run (a SystemExit, which no layer takes for the model's problem) when
the rank holds THREADS more threads than when this file was loaded (a shared launch's earlier runs leave threads of
their own): the hanging tool's calls must stay bounded.
"""

import itertools
import sys
import threading

from PIL import Image

from plumbing import calls
from features.tools import ToolCall, parse_qwen

calls.STRAY_CALLS = 8  # a hanging tool is refused after its first turn's calls: 2 episodes x HANGING per rank
HANGING = 6
THREADS = 16  # at most 12 stray calls, and a few of the libraries'; without the bound: 12 more a turn
BEFORE = threading.active_count()  # the tools file loads at start-up, before any tool call


def hang() -> str:
    """Never answer."""
    threading.Event().wait()
    return ""


def huge() -> str:
    """Answer at length."""
    return "x" * 20_000_000


def strip() -> Image.Image:
    """A picture too thin to read."""
    return Image.new("RGB", (30000, 2))


def exits() -> str:
    """Leave."""
    sys.exit(3)


def interrupts() -> str:
    """Be interrupted."""
    raise KeyboardInterrupt


TOOLS = [hang, huge, strip, exits, interrupts]


def raises(text: str) -> list[ToolCall]:
    raise RecursionError("maximum recursion depth exceeded")


DEGENERATE = ["<tool_call>" + "[" * 2000 + "</tool_call>",
              '<tool_call>{"name": "huge", "arguments": {"n": ' + "9" * 5000 + "}}</tool_call>"]
TURNS = [lambda text: [ToolCall("hang", {})] * HANGING, *[lambda text, name=name: [ToolCall(name, {})]
                                                          for name in ("huge", "strip", "exits", "interrupts")],
         *[lambda text, turn=turn: parse_qwen(turn) for turn in DEGENERATE], raises]
_turns = itertools.count()


def parse(text: str) -> list[ToolCall]:
    live = threading.active_count() - BEFORE
    if live > THREADS:
        raise SystemExit(f"hostile_tools: {live} threads more on this rank: the tool calls past their time are not "
                         "bounded")
    return TURNS[next(_turns) % len(TURNS)](text)
