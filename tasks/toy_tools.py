"""The built-in tool task "look it up": `torchrun --nproc_per_node 2 grpo.py toy_tools`
(--data.train-files toy_tools, --reward.function toy_tools, --tools.functions toy,
--tools.parser toy). The answer is a digit only the `lookup` tool knows."""

import random
import string

from features.tools import ToolCall
from rewards import RewardInput


def rows(split: str) -> list[dict]:
    """The prompt is a made-up four-letter word, the answer a digit that only the `lookup` tool
    knows; answer it and stop. train: 1024 rows, test: 50, seeded.

    >>> rows("test")[0]
    {'problem': 'eszy', 'answer': '1'}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_tools dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    return [{"problem": "".join(rng.choice(string.ascii_lowercase) for _ in range(4)),
             "answer": str(rng.randrange(10))}
            for _ in range(1024 if split == "train" else 50)]


def reward(inp: RewardInput) -> dict[str, float]:
    """Look the answer up (called), then answer with the digit the tool returned (accuracy, which
    needs the call: a guess scores nothing). overall = 0.2 called + 0.8 accuracy.

    ground truth "7": turns "?", tool "7", "7" -> 1.0; "?", tool "7", "3" -> 0.2;
    "7" (no call) -> 0.0.
    """
    called = float(any(m["role"] == "tool" for m in inp["messages"]))
    accuracy = called * float(inp["response"].strip().startswith(str(inp["ground_truth"])))
    return {"overall": 0.2 * called + 0.8 * accuracy, "called": called, "accuracy": accuracy}


def lookup(row: dict) -> str:
    """Look up the value this question asks for in the hidden table."""
    return str(row["answer"])


tools = [lookup]


def parser(text: str) -> list[ToolCall]:
    """The task's call syntax, which a random model hits from the start: a turn that does not begin
    with a digit (the answer) looks the answer up; the whole turn is the call.

    'ab' -> [ToolCall("lookup", {}, source="ab")]; ' 7' -> [] (an answer)
    """
    return [] if text.strip()[:1].isdigit() else [ToolCall("lookup", {}, source=text)]
