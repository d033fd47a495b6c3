"""The built-in code task: `grpo.py toy_code` (--data.train-files toy_code, scored by
--reward.function code, tasks/code.py). For a real model (the tiny one writes no Python):
`grpo.py code_qwen2_5_coder_1_5b`."""

import json
import random

CODE_TASKS = [  # (task, the answer to an input), inputs drawn by rows
    ("Read two integers on one line and print their sum.", lambda a, b: f"{a + b}"),
    ("Read two integers on one line and print their product.", lambda a, b: f"{a * b}"),
    ("Read two integers on one line and print the larger one.", lambda a, b: f"{max(a, b)}"),
    ("Read two integers a and b on one line and print a - b.", lambda a, b: f"{a - b}"),
    ("Read two integers on one line and print YES if they are equal, else NO.",
     lambda a, b: "YES" if a == b else "NO"),
    ("Read two integers a and b on one line and print the numbers from a to b, one per line "
     "(nothing if a > b).",
     lambda a, b: "\n".join(str(i) for i in range(a, b + 1))),
]


def rows(split: str) -> list[dict]:
    """Small stdin-to-stdout programs (CODE_TASKS), each with 3 tests, for the `code` reward (its
    sandbox runs the response's program on each test's input). train: 512 rows, test: 32, seeded.

    >>> row = rows("test")[0]; row["problem"][:44], json.loads(row["answer"])["tests"][0]
    ('Write a Python program. Read two integers on', {'input': '9 -7\n', 'output': '-63'})
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_code dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    rows = []
    for _ in range(512 if split == "train" else 32):
        task, answer = rng.choice(CODE_TASKS)
        pairs = [(rng.randint(-9, 9), rng.randint(-9, 9)) for _ in range(3)]
        tests = [{"input": f"{a} {b}\n", "output": answer(a, b)} for a, b in pairs]
        rows.append({"problem": f"Write a Python program. {task} "
                                "Answer with the program in a ```python block.",
                     "answer": json.dumps({"tests": tests})})
    return rows
