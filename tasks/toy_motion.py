"""The built-in video task "which way does the bar move": `grpo.py toy_motion` (a tiny
vision-language model; --data.train-files toy_motion, scored by --reward.function toy)."""

import random

import numpy as np
from PIL import Image


def rows(split: str) -> list[dict]:
    """4 frames of 56 x 56 pixels, a white bar 14 pixels wide (a patch) stepping 7 pixels a frame to
    the left or to the right, wrapping around; answer its letter (l or r) and stop. Its place in any
    one frame says nothing (every place is as likely either way): only frames together tell. A
    half-patch step shows in every patch the bar enters or leaves between two frames. train: 1024
    rows, test: 50, seeded.

    >>> row = rows("test")[0]; row["problem"], row["answer"], len(row["videos"][0])
    ('<video>', 'l', 4)
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_motion dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    rows = []
    for _ in range(1024 if split == "train" else 50):
        letter, start = rng.choice("lr"), rng.randrange(8)
        frames = []
        for t in range(4):
            frame = np.zeros((56, 56, 3), dtype=np.uint8)
            place = (start + (t if letter == "r" else -t)) % 8
            frame[:, (7 * place + np.arange(14)) % 56] = 255
            frames.append(Image.fromarray(frame))
        rows.append({"problem": "<video>", "answer": letter, "videos": [frames]})
    return rows
