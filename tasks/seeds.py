"""Rows for an environment that makes its own task from a seed (a TextArena game:
`--rollout.env textarena:GuessTheNumber-v0 --data.train-files seeds`, features/env.py's
TextArenaGame)."""


def rows(split: str) -> list[dict]:
    """An empty prompt (reset's answer is the task) and a seed. train: seeds 0 to 1023; test: 50
    others.

    >>> rows("test")[0]
    {'problem': '', 'answer': '', 'seed': 1000000}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the seeds dataset has the splits 'train' and 'test', not {split!r}")
    first, count = (0, 1024) if split == "train" else (1_000_000, 50)
    return [{"problem": "", "answer": "", "seed": seed} for seed in range(first, first + count)]
