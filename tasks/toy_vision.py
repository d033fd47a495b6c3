"""The built-in visual task "which colour fills the picture": `grpo.py toy_vision` (a tiny
vision-language model; --data.train-files toy_vision, scored by --reward.function toy)."""

import random

from PIL import Image

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220), "c": (30, 200, 200),
           "m": (200, 30, 200), "y": (220, 220, 30), "k": (10, 10, 10), "w": (245, 245, 245)}


def rows(split: str) -> list[dict]:
    """A picture (28 to 84 pixels a side) filled with one of 8 colours; answer its letter
    (r g b c m y k w) and stop. train: 1024 rows, test: 50, seeded.

    >>> row = rows("test")[0]; row["problem"], row["answer"], row["images"][0].size
    ('<image>', 'g', (84, 28))
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_vision dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    rows = []
    for _ in range(1024 if split == "train" else 50):
        letter = rng.choice(sorted(COLOURS))
        size = (28 * rng.randint(1, 3), 28 * rng.randint(1, 3))
        rows.append({"problem": "<image>", "answer": letter,
                     "images": [Image.new("RGB", size, COLOURS[letter])]})
    return rows
