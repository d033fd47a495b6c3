"""The built-in task "most common digit", the default job's:
`torchrun --nproc_per_node 2 grpo.py toy` (--data.train-files toy, --reward.function toy). Its
reward also scores toy_vision and toy_motion."""

import random

from rewards import RewardInput


def rows(split: str) -> list[dict]:
    """The prompt is 7 digits, 4 of them the same; answer that digit.

    train: 1024 rows from random.Random(0); test: 50 rows from random.Random(1).
    >>> rows("test")[0]
    {'problem': '2221512', 'answer': '2'}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    rows = []
    for _ in range(1024 if split == "train" else 50):
        answer = rng.randrange(10)
        digits = ([answer] * 4
                  + [rng.choice([d for d in range(10) if d != answer]) for _ in range(3)])
        rng.shuffle(digits)
        rows.append({"problem": "".join(map(str, digits)), "answer": str(answer)})
    return rows


def reward(inp: RewardInput) -> dict[str, float]:
    """The right digit first (accuracy), and then stopping right there (concise).

    overall = 0.5 accuracy + 0.5 accuracy * concise; accuracy: the stripped response starts with the
    answer; concise: it is exactly as long as the answer (the model emitted EOS right after it).
    Stopping only pays once the digit is right, so the model first learns the task, then to stop.
    ground truth "7": "7" -> 1.0; "77" -> 0.5 (right, did not stop); "8" -> 0.0; "" -> 0.0.
    """
    response, answer = inp["response"].strip(), str(inp["ground_truth"])
    accuracy = float(response.startswith(answer))
    concise = float(len(response) == len(answer))
    return {"overall": 0.5 * accuracy + 0.5 * accuracy * concise, "accuracy": accuracy,
            "concise": concise}
