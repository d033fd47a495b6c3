"""Prompt datasets: load `name[@split]`, render every prompt, serve seeded, resumable batches
to each rank.

Dataset format: one row per prompt; the column names are flags (--data.prompt-key,
--data.answer-key, --data.image-key, --data.video-key), other columns are kept and reach the reward
function with the row.

    {"problem": "What is 2 + 3?", "answer": "5", "images": [], "videos": [], ...any other columns}

- prompt (`problem`): text, rendered through the optional Jinja format prompt as `{{ content }}`,
  then through the tokenizer's chat template as one user turn with the generation prompt; or TRL's
  conversational form, a list of messages (system, turns, the user's last), rendered the same way,
  the format prompt applied to the last user message's text (PromptDataset.conversation):

    {"prompt": [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 2 + 3?"}], "solution": "5"}

- answer (`answer`): the ground truth, any type, handed untouched to the reward function (in a JSON
  file, one type per column: strings beside other types are refused, check_mixed_columns).
- images (`images`, optional): a list of PIL images, {"bytes": ...} dicts, raw bytes or paths
  (relative ones joined with --data.image-dir), for vision-language models. The prompt marks where
  each goes with a literal `<image>` (in a conversation, or a {"type": "image"} part: TRL's form),
  one per image, in order; rows without images are plain text (mixed datasets work):

    {"problem": "<image>How many squares are there?", "answer": "3", "images": ["clevr/0001.png"]}

- videos (`videos`, optional): a list per row of video files (paths, relative ones joined with
  --data.video-dir, or {"bytes": ...}) or of frame lists (each a list of images, as above), marked
  in the prompt with `<video>`:

    {"problem": "<video>Which way does the ball roll?", "answer": "left",
     "videos": ["clips/0001.mp4"]}

Where the rows come from (`name[@split]`, split `train` unless given):
    toy                      the built-in task "most common digit" (toy_rows): splits train and test
    toy_vision               the built-in visual task "which colour fills the picture"
                             (toy_vision_rows)
    toy_motion               the built-in video task "which way does the bar move" (toy_motion_rows)
    toy_tools                the built-in tool task "look it up" (toy_tool_rows; with
                             --tools.functions toy)
    toy_env                  the built-in environment task "open the vault" (toy_env_rows; with
                             --rollout.env toy)
    seeds                    an empty prompt and a seed a row, for environments that make their own
                             task (seed_rows)
    toy_code                 the built-in code task, programs run against tests (toy_code_rows;
                             --reward.function code)
    reasoning_gym:leg_counting  a task of the reasoning-gym package, generated (reasoning_gym_rows;
                             --reward.function reasoning_gym): splits train and test
    data/math12k.parquet     one parquet, json, jsonl or csv file: the file is the split (no @split)
    data/math12k@test        a folder of such files, split by file name (train.jsonl,
                             test-0000.parquet)
    hiyouga/math12k@test     a Hugging Face Hub dataset id (needs the network or a filled HF cache)

Design decisions:
- Prompts longer than max_prompt_length tokens are dropped at start-up, never truncated (a cut
  prompt is a different question, and a cut inside an image's tokens breaks the model); an image
  counts as the tokens the processor will give it. The count is kept in `num_filtered` for the
  trainer to log.
- Images are decoded and resized (min/max pixels) here, once: the engine and the trainer get the
  same pixels. The prompt holds one `<|image_pad|>` per image, the form vLLM expands itself.
- Videos too: their files are decoded with PyAV (FFmpeg's decoders and a container's own frame count
  and rate, in a wheel bound to no torch version, unlike torchcodec; decord is unmaintained and
  torchvision 0.28 has no reader), `--data.video-fps` frames a second are kept, uniformly, up to
  `--data.max-frames`, and each is resized like an image. A video's tokens are counted from its
  container's frame count, rate and size; at the same time each file is checked without being
  decoded in full (every packet read, the first frame decoded: probe_video), so that a file cut
  short is refused at start-up, not when its row is first drawn. A video's frames are one size:
  frames of two sizes are refused, not stretched to one.
- Dataset text is text: a row whose prompt holds a control token of the tokenizer (`<|im_end|>`, an
  image placeholder) is refused rather than tokenized as one, which would let the data end the
  user's turn in the model's input. Splitting the rendered prompt to tokenize the row's text without
  specials would tokenize differently from what the engine is given; `--data.allow-special-tokens`
  keeps such rows as they are.
- Validation data is the training data's own held-out split or none (`validation_files`): a default
  taken from elsewhere would be reported as the run's score.
- Every rank loads the whole dataset and draws the same permutation (seed + epoch), then takes its
  contiguous share of each global batch: no sampler, no communication.
- The loader's position counts global prompts, so a resumed run gets the identical next batch, even
  on a different number of ranks (with the same global batch size).
- The incomplete last batch of an epoch is dropped: every step sees exactly batch_size prompts.
"""

import codecs
import difflib
import functools
import io
import json
import math
import random
import re
import string
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import av
import datasets
import numpy as np
import pyarrow
import pyarrow.parquet
from datasets.fingerprint import generate_random_fingerprint
from PIL import Image

from plumbing.loading import load_template
from model.vision import Video, image_tokens, placeholder_tokens, video_metadata, video_tokens

FILE_TYPES = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# marks where the user's text ends in a rendering, to leave the turn open there (open_turn)
OPEN_TURN = "\ue002"


@dataclass
class DataConfig:
    train_files: str = "toy"
    """Training data `name[@split]`: `toy` (built-in task), `reasoning_gym:NAME` (a reasoning-gym
    task), a parquet/json/jsonl/csv file, a folder of them, or a hub id; split `train` unless
    given."""
    val_files: str = "auto"
    """Validation data, same format (e.g. `data/math12k@test`); auto: the training data's own test
    (or validation) split if it has one, else none; empty: none."""
    prompt_key: str = "problem"
    """Column holding the prompt: text, or a list of chat messages (TRL's conversational form,
    whose column is `prompt`)."""
    answer_key: str = "answer"
    """Column holding the ground truth passed to the reward function."""
    image_key: str = "images"
    """Column holding each row's list of images (vision-language models);
    ignored when the dataset has no such column."""
    image_dir: str = ""
    """Folder that relative image paths of the images column are joined with (empty: the working
    directory)."""
    video_key: str = "videos"
    """Column holding each row's list of videos (files, or lists of frames) for vision-language
    models; ignored when the dataset has no such column."""
    video_dir: str = ""
    """Folder that relative video paths of the videos column are joined with
    (empty: --data.image-dir)."""
    video_fps: float = 2.0
    """Frames kept per second of video, spread uniformly over it; a list of frames is taken as
    sampled at this rate."""
    max_frames: int = 32
    """Frames kept per video at most (rounded down to an even number: the models read frames in
    pairs)."""
    min_pixels: int = 262144
    """Images (and video frames) with fewer pixels are scaled up to this many (aspect ratio kept),
    once, for rollout and training alike."""
    max_pixels: int = 4194304
    """Images (and video frames) with more pixels are scaled down to this many;
    it bounds each image's tokens (pixels / 28^2 for Qwen2.5-VL) and each frame pair's."""
    format_prompt: str = ""
    """Jinja template rendering the prompt as `{{ content }}` (a conversation's last user message),
    e.g. templates/math.jinja (also found next to data.py); empty: the prompt as is."""
    allow_special_tokens: bool = False
    """Keep prompts whose text holds the tokenizer's control tokens (`<|im_end|>`, ...), which then
    act as such; refused by default (dataset text is text)."""
    max_prompt_length: int = 256
    """Prompts longer than this many tokens (chat template included) are dropped at start-up; the
    count is logged."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded by seed + epoch)."""
    seed: int = 1
    """Seed of the shuffling."""


# -------------------------------------------------------- rows: toy task, files, folders, hub


def toy_rows(split: str) -> list[dict]:
    """The built-in task "most common digit": the prompt is 7 digits, 4 of them the same; answer
    that digit.

    train: 1024 rows from random.Random(0); test: 50 rows from random.Random(1).
    >>> toy_rows("test")[0]
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


COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220), "c": (30, 200, 200),
           "m": (200, 30, 200), "y": (220, 220, 30), "k": (10, 10, 10), "w": (245, 245, 245)}


def toy_vision_rows(split: str) -> list[dict]:
    """The built-in visual task "which colour fills the picture": a picture (28 to 84 pixels a side)
    filled with one of 8 colours; answer its letter (r g b c m y k w) and stop. train: 1024 rows,
    test: 50, seeded.

    >>> row = toy_vision_rows("test")[0]; row["problem"], row["answer"], row["images"][0].size
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


def toy_motion_rows(split: str) -> list[dict]:
    """The built-in video task "which way does the bar move": 4 frames of 56 x 56 pixels, a white
    bar 14 pixels wide (a patch) stepping 7 pixels a frame to the left or to the right, wrapping
    around; answer its letter (l or r) and stop. Its place in any one frame says nothing (every
    place is as likely either way): only frames together tell. A half-patch step shows in every
    patch the bar enters or leaves between two frames. train: 1024 rows, test: 50, seeded.

    >>> row = toy_motion_rows("test")[0]; row["problem"], row["answer"], len(row["videos"][0])
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


def toy_tool_rows(split: str) -> list[dict]:
    """The built-in tool task "look it up": the prompt is a made-up four-letter word, the answer a
    digit that only the `lookup` tool (tools.py) knows; answer it and stop. train: 1024 rows,
    test: 50, seeded.

    >>> toy_tool_rows("test")[0]
    {'problem': 'eszy', 'answer': '1'}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_tools dataset has the splits 'train' and 'test', not {split!r}")
    rng = random.Random(0 if split == "train" else 1)
    return [{"problem": "".join(rng.choice(string.ascii_lowercase) for _ in range(4)),
             "answer": str(rng.randrange(10))}
            for _ in range(1024 if split == "train" else 50)]


def toy_env_rows(split: str) -> list[dict]:
    """The built-in environment task "open the vault" (env.ToyVault): the prompt is a made-up
    four-letter word, the answer a digit, the vault's code; `clue` is what the vault says to the
    model's first turn, 7 digits of which 4 are the code (the default job's task, told by the
    environment). train: 1024 rows, test: 50, seeded.

    >>> toy_env_rows("test")[0]
    {'problem': 'eszy', 'answer': '2', 'clue': '2221512'}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_env dataset has the splits 'train' and 'test', not {split!r}")
    words = [row["problem"] for row in toy_tool_rows(split)]
    return [{"problem": word, "answer": row["answer"], "clue": row["problem"]}
            for word, row in zip(words, toy_rows(split))]


def seed_rows(split: str) -> list[dict]:
    """Rows for an environment that makes its own task from a seed (a TextArena game:
    env.TextArenaGame): an empty prompt (reset's answer is the task) and a seed.
    train: seeds 0 to 1023; test: 50 others.

    >>> seed_rows("test")[0]
    {'problem': '', 'answer': '', 'seed': 1000000}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the seeds dataset has the splits 'train' and 'test', not {split!r}")
    first, count = (0, 1024) if split == "train" else (1_000_000, 50)
    return [{"problem": "", "answer": "", "seed": seed} for seed in range(first, first + count)]


CODE_TASKS = [  # (task, the answer to an input), inputs drawn by toy_code_rows
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


def toy_code_rows(split: str) -> list[dict]:
    """The built-in code task: small stdin-to-stdout programs (CODE_TASKS), each with 3 tests, for
    the `code` reward (its sandbox runs the response's program on each test's input).
    train: 512 rows, test: 32, seeded. For a real model (the tiny one writes no Python):
    `grpo.py code_qwen2_5_coder_1_5b`.

    >>> row = toy_code_rows("test")[0]; row["problem"][:44], json.loads(row["answer"])["tests"][0]
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


BUILTIN_ROWS = {"toy": toy_rows, "toy_vision": toy_vision_rows, "toy_motion": toy_motion_rows,
                "toy_tools": toy_tool_rows, "toy_env": toy_env_rows, "seeds": seed_rows,
                "toy_code": toy_code_rows}


# -------------------------------------------------------- rows: reasoning-gym's generated tasks

REASONING_GYM = "reasoning_gym:"
# (seed, rows) of each split. Nearly every task draws its row i from Random(seed + i): the test
# split's seeds start far past the train split's last (a test seed of 1 would make the test
# rows train rows 1 to 128)
REASONING_GYM_SPLITS = {"train": (0, 2048), "test": (1_000_000, 128)}


@functools.lru_cache(maxsize=8)
def reasoning_gym_task(name: str, seed: int, size: int):
    """reasoning-gym's task `name` at its default settings, `size` rows from `seed` (a reasoning_gym
    ProceduralDataset: item i is row i, generated when asked). reasoning_gym is imported here, only
    when a run asks for a task: its import takes a second or more. Kept: the reward scores with the
    same object (reasoning_gym_entry).
    """
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"dataset {REASONING_GYM}{name} needs reasoning-gym: "
                         "pip install reasoning-gym") from None
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=5)
        raise ValueError(f"--data.train-files (or --data.val-files) {REASONING_GYM}{name}: "
                         f"reasoning-gym has no task {name!r}" +
                         (f"; close names: {', '.join(close)}" if close else "") +
                         f"; all {len(DATASETS)}: python -c 'import reasoning_gym.factory as f; "
                         "print(*sorted(f.DATASETS))'")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size)
    except Exception as error:  # composite: a mix of tasks, which needs a config of its own
        raise ValueError(f"dataset {REASONING_GYM}{name}: reasoning-gym cannot make {name!r} "
                         f"at its default settings ({type(error).__name__}: {error}); "
                         "choose another task") from error


def reasoning_gym_rows(name: str, split: str) -> list[dict]:
    """The rows of a reasoning-gym task (`reasoning_gym:NAME[@split]`, e.g.
    reasoning_gym:leg_counting), generated at the task's default settings: train 2,048 rows from
    seed 0, test 128 from seed 1,000,000 (REASONING_GYM_SPLITS). Each row: the question, the answer
    (None for a task with many right answers, which its verifier checks), and where the row comes
    from, from which the reward regenerates the entry its verifier reads (reasoning_gym_entry).

    Generated on every rank at start-up, so the sizes are those most tasks make in well under a
    second: leg_counting makes its 2,048 in 0.03 s, basic_arithmetic in 0.06, spell_backward in
    0.08, knights_knaves in 1.1, and 85 of reasoning-gym 0.1.25's 105 tasks in under 2 s; those that
    search for their puzzles take minutes (countdown 44 s, zebra_puzzles 160, knight_swap
    15 minutes). Six tasks draw from sets (of letters, of words), whose order Python's string
    hashing sets anew in every process: their rows differ between ranks and launches unless
    PYTHONHASHSEED is set (the README's Data section names them).

    >>> row = reasoning_gym_rows("leg_counting", "test")[0]; row["answer"], row["reasoning_gym"]
    ('134', {'dataset': 'leg_counting', 'seed': 1000000, 'size': 128, 'index': 0})
    """
    if split not in REASONING_GYM_SPLITS:
        raise ValueError(f"the reasoning-gym dataset {REASONING_GYM}{name} has the splits 'train' "
                         f"and 'test', not {split!r}")
    seed, size = REASONING_GYM_SPLITS[split]
    task, rows = reasoning_gym_task(name, seed, size), []
    for index in range(size):
        entry = task[index]
        rows.append({"problem": entry["question"], "answer": entry["answer"],
                     "reasoning_gym": {"dataset": name, "seed": seed, "size": size,
                                       "index": index}})
    return rows


@functools.lru_cache(maxsize=1024)
def reasoning_gym_entry(dataset: str, seed: int, size: int, index: int) -> dict:
    """The entry a reasoning-gym row was made from, {"question", "answer", "metadata"}, generated
    again from the row's `reasoning_gym` column: its metadata (tuples, ints, Fractions, numpy
    values) would not survive a dataset's columns, and a task makes row i again the same in the
    process that made it (reasoning-gym's own trainer scores so; list_functions does not always,
    which the reward finds and refuses). Cached: the n responses to a prompt regenerate its
    entry once."""
    return reasoning_gym_task(dataset, seed, size)[index]


def validation_files(train_files: str, val_files: str) -> tuple[str, str]:
    """The validation data `--data.val-files` names ('' for none) and a note on where it comes from.

    auto: the training dataset's own `test` split, else its `validation` split; a single file, or a
    dataset with neither, has no validation (the note says so). Never another dataset: scores on
    data the run does not train on would be reported as the run's own.
    >>> validation_files("toy", "auto")
    ('toy@test', 'validation: toy@test, the test split of the training data')
    """
    if val_files != "auto":
        return val_files, (f"validation: {val_files}" if val_files
                           else "no validation (--data.val-files is empty)")
    name, split = parse_spec(train_files)
    path = Path(name).expanduser()
    if name in BUILTIN_ROWS or name.startswith(REASONING_GYM):
        splits = ["train", "test"]
    elif path.is_file():
        return "", (f"no validation: {train_files} is a single file, which has no test split "
                    "(--data.val-files to give one)")
    else:
        try:
            splits = datasets.get_dataset_split_names(str(path) if path.is_dir() else name)
        except Exception:  # an unreachable hub: the training data's loading says why
            splits = []
    for candidate in ("test", "validation"):
        if candidate in splits and candidate != (split or "train"):
            spec = f"{name}@{candidate}"
            return spec, f"validation: {spec}, the {candidate} split of the training data"
    return "", (f"no validation: {train_files} has no test or validation split to hold out "
                "(--data.val-files to give one)")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`name[@split]` -> (name, split or None). `data/x.jsonl@test` -> ("data/x.jsonl", "test")."""
    name, at, split = spec.rpartition("@")
    if not at or not name or "/" in split:  # an '@' inside a path is not a split
        return spec, None
    return name, split


def _load(description: str, *args, files: list[Path], **kwargs) -> datasets.Dataset:
    """datasets.load_dataset, with a failure reported as a ValueError naming what was being read
    (the line, when a JSON Lines file of `files` has one that is not JSON); a dataset without rows
    is refused too."""
    try:
        rows = datasets.load_dataset(*args, **kwargs)
    except Exception as error:
        for file in files:
            check_json_lines(file)
        raise ValueError(f"could not read dataset {description}: {type(error).__name__}: "
                         f"{error}") from error
    if len(rows) == 0:
        raise ValueError(f"dataset {description} has no rows")
    check_mixed_columns(rows, files)
    return rows


JSON_TYPES = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
              dict: "an object", list: "a list"}


def check_mixed_columns(rows: datasets.Dataset, files: list[Path]) -> None:
    """Refuse a JSON column that holds strings beside values of other types: `datasets` types such a
    column as JSON and then reads every string of it as JSON text ("007" becomes 7, "1.50" 1.5,
    "true" True), so the answers a grader compares would no longer be the ones written. Names the
    file, the column and a line of each type."""
    mixed = [name for name, feature in rows.features.items()
             if isinstance(feature, datasets.Json)]
    if not mixed:
        return
    for file in (f for f in files if f.suffix in (".jsonl", ".json")):
        with open(file, encoding="utf-8") as handle:
            if file.suffix == ".jsonl":
                lines = [(number, json.loads(line))
                         for number, line in enumerate(handle, 1) if line.strip()]
            else:  # a .json file: a list of rows (another layout is not checked)
                lines = list(enumerate(json.load(handle), 1))
        for name in mixed:
            seen = {}  # a type's name -> the first line holding it
            for number, row in lines:
                if isinstance(row, dict) and row.get(name) is not None:
                    seen.setdefault(JSON_TYPES.get(type(row[name]), type(row[name]).__name__),
                                    number)
            if "a string" in seen and len(seen) > 1:
                where = ", ".join(f"{kind} on line {number}" for kind, number in
                                  sorted(seen.items(), key=lambda item: item[1]))
                raise ValueError(f"dataset file {file}: column {name!r} holds {where}; `datasets` "
                                 "would then read every string of it as JSON (\"007\" as 7, "
                                 "\"1.50\" as 1.5): write all of its values as strings (or all as "
                                 "one other type)")


def check_file(path: Path) -> None:
    """Refuse a data file that `datasets` would read wrongly or report in its own terms: a parquet
    file without rows, an empty text file, text that is not UTF-8 (its bad bytes would surface
    later, at the row, as an error naming only the codec). Read in blocks: a file of any size."""
    if path.suffix == ".parquet":
        try:
            rows = pyarrow.parquet.read_metadata(path).num_rows
        except pyarrow.ArrowException as error:
            raise ValueError(f"dataset file {path} is not a readable parquet file: "
                             f"{error}") from error
        if rows == 0:
            raise ValueError(f"dataset file {path} has no rows")
        return
    decoder, offset, lines, content = codecs.getincrementaldecoder("utf-8")(), 0, 1, False
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as error:
                where = offset + error.start
                line = lines + block.count(b"\n", 0, error.start)
                raise ValueError(f"dataset file {path} is not UTF-8 text: byte "
                                 f"{block[error.start]:#04x} at offset {where} (line {line}); "
                                 "save it as UTF-8") from None
            offset, lines, content = (offset + len(block), lines + block.count(b"\n"),
                                      content or bool(block.strip()))
    if not content:
        raise ValueError(f"dataset file {path} is empty")


def check_json_lines(path: Path) -> None:
    """Name the first line of a JSON Lines file that is not JSON (run once `datasets` has failed to
    read it)."""
    if path.suffix != ".jsonl":
        return
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            try:
                line.strip() and json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"dataset file {path}, line {number}: not JSON "
                                 f"({error.msg} at column {error.colno}); "
                                 "a .jsonl file holds one JSON object per line") from None


def load_rows(spec: str) -> datasets.Dataset:
    """The rows of `name[@split]`: a built-in task, a reasoning-gym task, a local file or folder, or
    a hub dataset (module docstring)."""
    name, split = parse_spec(spec)
    path = Path(name).expanduser()
    if name in BUILTIN_ROWS:
        return datasets.Dataset.from_list(BUILTIN_ROWS[name](split or "train"))
    if name.startswith(REASONING_GYM):
        return datasets.Dataset.from_list(
            reasoning_gym_rows(name.removeprefix(REASONING_GYM), split or "train"))
    if path.is_file():
        if split is not None:
            raise ValueError(f"dataset {spec!r}: a single file has no splits, the file is the "
                             f"split; drop '@{split}' or point at a folder of files named by split")
        if path.suffix not in FILE_TYPES:
            raise ValueError(f"dataset file {path} has an unsupported type; use one of "
                             f"{sorted(FILE_TYPES)}")
        check_file(path)
        return _load(f"file {path}", FILE_TYPES[path.suffix], data_files=str(path), split="train",
                     files=[path])
    split = split or "train"
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.suffix in FILE_TYPES and f.is_file())
        for file in files:
            check_file(file)
        return _load(f"folder {path} (split {split!r})", str(path), split=split, files=files)
    if path.suffix in FILE_TYPES or name.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"dataset file or folder {str(path.absolute())!r} does not exist")
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as error:
        raise ValueError(
            f"could not load {name!r} (split {split!r}) from the Hugging Face Hub: "
            f"{type(error).__name__}: {error}. No local file or folder has that name either. "
            "If this machine is offline, download the dataset elsewhere and pass a local file or "
            "folder (e.g. --data.train-files data/math12k.parquet)"
        ) from error


# -------------------------------------------------------- prompts: templates and the length filter


class PromptItem(TypedDict):
    """One prompt, ready for the rollout (what PromptDataset[i] is).
    With the Qwen chat template, e.g.

        {"prompt": "<|im_start|>user\\n2221512<|im_end|>\\n<|im_start|>assistant\\n",
         "prompt_ids": [1, 38, 36, 22, 35, 104, ...], "ground_truth": "2",
         "row": {"problem": "2221512", "answer": "2"}, "images": [], "videos": []}
    """

    prompt: str  # the chat-templated text
    prompt_ids: list[int]  # its tokens, no special tokens added
    ground_truth: Any  # row[answer_key], any type
    row: dict  # the full row, for the reward function
    images: list  # row[image_key] as PIL images, resized; [] when absent / None
    videos: list[Video]  # row[video_key], frames sampled and resized; [] when absent / None


class PromptDataset:
    """The prompts of one dataset, ready for the rollout: item i is a PromptItem. `processor`: the
    model's (vision-language models), which renders prompts with images and videos and says how many
    tokens each costs; `tools`: the JSON schemas of the tools offered, which the chat template lists
    in the prompt (tools.py); `open_turn`: each prompt ends with the user's text, the rest of the
    turn left to the episode (an environment class's reset ends it: env.py)."""

    def __init__(self, rows: datasets.Dataset, cfg: DataConfig, tokenizer, name: str,
                 processor=None, tools: list[dict] | None = None, open_turn: bool = False):
        for key, flag in ((cfg.prompt_key, "--data.prompt-key"),
                          (cfg.answer_key, "--data.answer-key")):
            if key not in rows.column_names:
                raise ValueError(f"dataset {name!r} has no column {key!r} (its columns: "
                                 f"{rows.column_names}); set {flag} to the right one")
        self.cfg, self.tokenizer, self.name, self.processor, self.tools = (
            cfg, tokenizer, name, processor, tools)
        self.open_turn = open_turn
        self.template = (load_template(cfg.format_prompt, "--data.format-prompt")
                         if cfg.format_prompt else None)
        self.has_images = cfg.image_key in rows.column_names
        self.has_videos = cfg.video_key in rows.column_names
        # an image slot without its image breaks the model whatever the flag says; other control
        # tokens in a dataset's text would start or end turns of the conversation the model reads
        # (a prompt injection)
        slots = set(placeholder_tokens(processor)) if processor is not None else set()
        controls = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special} | slots
        self.forbidden, self.slots = sorted(slots if cfg.allow_special_tokens else controls), slots

        def fits(text, index: int, images=(), videos=()) -> bool:
            length = len(self.prompt_ids(self.prompt(text, index, len(images), len(videos))))
            # one <|image_pad|> in the prompt becomes the image's tokens
            for number, image in enumerate(images):
                width, height = resized_size(
                    *open_image(image, cfg.image_dir, self.where(index, number)).size,
                    cfg.min_pixels, cfg.max_pixels)
                length += self.tokens(image_tokens, (width, height), index, image=number,
                                      source=image) - 1
            for number, video in enumerate(videos):  # and one <|video_pad|> its video's
                where = self.where(index, video=number)
                total, fps, size = probe_video(video, cfg, where)
                metadata = video_metadata(
                    fps, frame_indices(total, fps, cfg.video_fps, cfg.max_frames), total,
                    *resized_size(*size, cfg.min_pixels, cfg.max_pixels))
                length += self.tokens(video_tokens, metadata, index, video=number,
                                      source=video) - 1
            return length <= cfg.max_prompt_length

        # only the prompt, image and video columns are read; images and videos only as far as
        # their size
        media = [(name, key)
                 for name, key, present in (("images", cfg.image_key, self.has_images),
                                            ("videos", cfg.video_key, self.has_videos))
                 if present]

        def keep(text, *values):  # the media columns' values, then the row's index
            for (name, key), value in zip(media, values):
                if value is not None and not isinstance(value, (list, tuple)):
                    raise ValueError(f"{self.where(values[-1])}: column {key!r} must hold a list "
                                     f"of {name}, got a {type(value).__name__} ({value!r:.60}); "
                                     f"a row with one {name[:-1]} holds a list of one")
            return fits(text, values[-1],
                        **{name: value or [] for (name, _), value in zip(media, values)})

        # a fingerprint of our own: datasets would hash `keep` and all it refers to (a 151k-token
        # tokenizer: a minute)
        self.rows = rows.filter(keep, input_columns=[cfg.prompt_key] + [key for _, key in media],
                                with_indices=True, keep_in_memory=True,
                                new_fingerprint=generate_random_fingerprint(),
                                desc=f"dropping prompts over {cfg.max_prompt_length} tokens")
        self.num_filtered = len(rows) - len(self.rows)
        if len(self.rows) == 0:
            raise ValueError(f"all {len(rows)} prompts of dataset {name!r} are longer than "
                             f"{cfg.max_prompt_length} tokens (images and videos included); "
                             "raise --data.max-prompt-length" +
                             (" or lower --data.max-pixels" if media else "") +
                             (" or --data.max-frames" if self.has_videos else ""))

    def where(self, index: int, image: int | None = None, video: int | None = None) -> str:
        return (f"dataset {self.name!r}, row {index}" +
                (f", image {image}" if image is not None else "") +
                (f", video {video}" if video is not None else ""))

    def tokens(self, count, what, index: int, source, **which) -> int:
        """`count(processor, what)`: the tokens the processor gives an image of a size or a video of
        a metadata; an error names the row, the item and its file (a model without a processor, or
        the processor's own limits: Qwen-VL's aspect ratio below 200)."""
        kind = "images" if "image" in which else "videos"
        if self.processor is None:
            raise ValueError(f"{self.where(index)} has {kind}, but the model has no processor: "
                             f"{kind[:-1]} rows need a vision-language model (--actor.model-path), "
                             f"or drop the {kind} (--data.{kind[:-1]}-key)")
        try:
            return count(self.processor, what)
        except ValueError as error:
            file = f" (file {source!r})" if isinstance(source, str) else ""
            size = what if isinstance(what, tuple) else (what["width"], what["height"])
            raise ValueError(f"{self.where(index, **which)}{file}, {size[0]} x {size[1]} pixels "
                             f"after resizing: {error}") from None

    def prompt(self, value, index: int, num_images: int = 0, num_videos: int = 0) -> str:
        """Row `index`'s prompt -> its messages (conversation) -> the format template on the last
        user message -> chat template, with the generation prompt (after a last assistant message,
        that message continued instead, TRL's prefill; with `open_turn`, the rendering up to the end
        of the user's text).

        In an image (video) dataset, each `<image>` (`<video>`) of a message becomes an image
        (video) part of it, which the chat template renders as
        `<|vision_start|><|image_pad|><|vision_end|>` (`<|video_pad|>`). A conversation that marks
        no image gets its images at the start of its first user message (TRL's rule).
        """
        messages = self.conversation(value, index)
        for token in self.forbidden:
            if any(token in message["role"] + message["content"] for message in messages):
                raise ValueError(f"{self.where(index)}: the prompt holds {token!r}, a control "
                                 "token of the model's tokenizer, which would act as one in its "
                                 "input" +
                                 (": put `<image>` where an image goes, `<video>` where a "
                                  "video goes" if token in self.slots
                                  else "; remove it, or pass --data.allow-special-tokens if "
                                  "the dataset really carries control tokens"))
        users = [message for message in messages if message["role"] == "user"]
        if self.template and users:
            users[-1]["content"] = self.template.render(content=users[-1]["content"])
        if (not isinstance(value, str) and num_images and users
                and not any("<image>" in message["content"] for message in messages)):
            users[0]["content"] = "<image>" * num_images + users[0]["content"]
        everything = "".join(message["content"] for message in messages)
        marks = [f"<{kind}>" for kind, count, present in (("image", num_images, self.has_images),
                                                          ("video", num_videos, self.has_videos))
                 if present and (count or f"<{kind}>" in everything)]
        for mark, count in (("<image>", num_images), ("<video>", num_videos)):
            if mark in marks and everything.count(mark) != count:
                raise ValueError(f"{self.where(index)}: {everything.count(mark)} {mark} "
                                 f"placeholders for {count} {mark[1:-1]}s; put one {mark} (or a "
                                 f"{{'type': '{mark[1:-1]}'}} part) in the prompt where each "
                                 f"{mark[1:-1]} goes, in order")
        last = messages[-1]
        if self.open_turn:
            if last["role"] != "user":
                raise ValueError(f"{self.where(index)}: the prompt ends with the {last['role']}'s "
                                 "message, and the environment's reset ends the user's: end each "
                                 "prompt with the user's message")
            last["content"] += OPEN_TURN
        if marks:  # each message: text, image, text, video, ..., text
            for message in messages:
                message["content"] = [{"type": part[1:-1]} if part in marks
                                      else {"type": "text", "text": part}
                                      for part in re.split("(" + "|".join(marks) + ")",
                                                           message["content"]) if part]
        renderer = self.processor if self.processor is not None else self.tokenizer
        text = renderer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                            add_generation_prompt=last["role"] == "user",
                                            continue_final_message=last["role"] == "assistant")
        return text[:text.index(OPEN_TURN)] if self.open_turn else text

    def conversation(self, value, index: int) -> list[dict]:
        """A prompt column's value as messages of text, their images and videos marked `<image>`
        and `<video>`: text is one user message; TRL's conversational form, a list of
        {"role", "content"} messages (system, user, assistant: the last the user's, or the
        assistant's to continue), each content text or a list of parts ({"type": "text", "text":
        ...}, {"type": "image"}, {"type": "video"}), is the conversation as it is.

        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
        -> [{"role": "user", "content": "<image>Colour?"}]
        """
        where = self.where(index)
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(message, Mapping) for message in value)):
            raise ValueError(f"{where}: column {self.cfg.prompt_key!r} must hold text or a list of "
                             "messages ({'role': ..., 'content': ...}, TRL's conversational "
                             f"form), got {type(value).__name__} {value!r:.80}")
        messages = []
        for number, message in enumerate(value):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise ValueError(f"{where}, message {number}: needs a 'role' (system, user or "
                                 f"assistant), got {role!r:.40}")
            if isinstance(content, (list, tuple)):
                content = "".join(self.part(part, f"{where}, message {number}, part {p}")
                                  for p, part in enumerate(content))
            if not isinstance(content, str):
                raise ValueError(f"{where}, message {number}: 'content' must be text or a list of "
                                 f"parts, got {type(content).__name__} {content!r:.60}" +
                                 ("" if content is None else
                                  "; in a JSON file whose messages mix text contents with lists of "
                                  "parts, `datasets` reads the text as JSON (\"5\" as 5): write "
                                  "every content as a list of parts"))
            messages.append({"role": role, "content": content})
        if messages[-1]["role"] not in ("user", "assistant"):
            raise ValueError(f"{where}: the last message is the {messages[-1]['role']}'s; a prompt "
                             "ends with the user's message (or the assistant's, to continue)")
        return messages

    def part(self, part, where: str) -> str:
        """One part of a message's content as text: a text part's text, an image (video) part
        `<image>` (`<video>`), whose image is the row's next of its images column."""
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            return part["text"]
        for media, key, flag, present in (("image", self.cfg.image_key, "--data.image-key",
                                           self.has_images),
                                          ("video", self.cfg.video_key, "--data.video-key",
                                           self.has_videos)):
            if kind == media and part.get(media) is not None:
                raise ValueError(f"{where}: a part holding its {media}; put the row's {media}s in "
                                 f"its column {key!r}, the parts as {{'type': '{media}'}}")
            if kind == media and not present:
                raise ValueError(f"{where}: a part of type {media!r}, and the dataset has no "
                                 f"column {key!r} of {media}s ({flag})")
            if kind == media:
                return f"<{media}>"
        raise ValueError(f"{where}: a part must be {{'type': 'text', 'text': ...}}, "
                         f"{{'type': 'image'}} or {{'type': 'video'}}, got {part!r:.80}")

    def prompt_ids(self, prompt: str) -> list[int]:
        # the chat template already wrote the special tokens, so the tokenizer must not add a
        # BOS again
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptItem:
        row, cfg = self.rows[index], self.cfg
        images = [resize_image(open_image(value, cfg.image_dir, self.where(index, number)),
                               cfg.min_pixels, cfg.max_pixels)
                  for number, value in enumerate(row.get(cfg.image_key) or [])]
        videos = [read_video(value, cfg, self.where(index, video=number))
                  for number, value in enumerate(row.get(cfg.video_key) or [])]
        prompt = self.prompt(row[cfg.prompt_key], index, len(images), len(videos))
        return PromptItem(prompt=prompt, prompt_ids=self.prompt_ids(prompt),
                          ground_truth=row[cfg.answer_key], row=row, images=images, videos=videos)


# -------------------------------------------------------- images: decoding and the pixel budget


def file_source(value, folder: str, flag: str, where: str, forms: str) -> tuple[Any, str]:
    """A file entry of an images or videos column -> (what to open: a path, or the bytes in a
    buffer; how the errors name it). {"bytes": b"..."} (or {"path": ...}, as `datasets` stores
    images), raw bytes, or a path (relative ones joined with `folder`, the value of `flag`);
    anything else is refused, naming the `forms` accepted."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        path = Path(folder) / value if folder else Path(value)
        return str(path), f"file {str(path)!r} ({flag} {folder!r})"
    if isinstance(value, bytes):
        return io.BytesIO(value), f"{len(value)} bytes"
    raise ValueError(f"{where}: {forms}, got {type(value).__name__}")


def open_image(value, image_dir: str, where: str, flag: str = "--data.image-dir") -> Image.Image:
    """One entry of an images column (or a video's frame) -> a PIL image (opened lazily: its size is
    known before its pixels are read): a PIL image, or a file (file_source). `where` names the
    dataset, row and image in the errors."""
    if isinstance(value, Image.Image):
        return value
    source, description = file_source(
        value, image_dir, flag, where,
        "an image must be a PIL image, {'bytes': ...}, bytes or a path")
    try:
        return Image.open(source)
    except (OSError, Image.UnidentifiedImageError) as error:
        raise ValueError(f"{where}: cannot read image {description}: {error}") from error


def resized_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size resize_image gives an image: (400, 300) with max_pixels 30,000 -> (200, 150)."""
    pixels = width * height
    if pixels > max_pixels or pixels < min_pixels:
        factor = math.sqrt((max_pixels if pixels > max_pixels else min_pixels) / pixels)
        return int(width * factor), int(height * factor)
    return width, height


def resize_image(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """Scale an image (aspect ratio kept) into [min_pixels, max_pixels] pixels, as RGB: the pixels
    the engine and the trainer both see (the processor then rounds the size to its patch grid)."""
    size = resized_size(image.width, image.height, min_pixels, max_pixels)
    image = image.resize(size) if size != image.size else image
    return image.convert("RGB")


# -------------------------------------------------------- videos: decoding and the frames kept


def frame_indices(total: int, fps: float, video_fps: float, max_frames: int) -> list[int]:
    """The frames kept of a `total`-frame video at `fps` frames a second: `video_fps` a second,
    spread uniformly from the first frame to the last, an even number (the models read frames in
    pairs) from 2 to `max_frames` (rounded down to even) and to `total` (rounded up: a one-frame
    video is its frame twice).

    >>> frame_indices(100, 25.0, 2.0, 32)  # 4 seconds: 8 frames
    [0, 14, 28, 42, 57, 71, 85, 99]
    >>> frame_indices(1, 25.0, 2.0, 32), frame_indices(4, 2.0, 2.0, 32)
    ([0, 0], [0, 1, 2, 3])
    """
    count = min(2 * max(1, round(total / fps * video_fps / 2)),
                max(2, max_frames - max_frames % 2), total + total % 2)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


REPLACE = "re-encode it (ffmpeg -i IN OUT), give its frames as a list of images, or drop the row"


def video_folder(cfg: DataConfig) -> tuple[str, str]:
    """(the folder relative video paths and frame paths are joined with, the flag that names it)."""
    return ((cfg.video_dir, "--data.video-dir") if cfg.video_dir
            else (cfg.image_dir, "--data.image-dir"))


def open_frame(value, cfg: DataConfig, where: str) -> Image.Image:
    """One frame of a list of frames: an image in any form of an images column, relative paths
    in video_folder."""
    folder, flag = video_folder(cfg)
    return open_image(value, folder, where, flag)


@contextmanager
def open_video(value, cfg: DataConfig, where: str):
    """A video file of a videos column (file_source) opened with PyAV: (container, its first video
    stream, how the errors name it), its errors naming the row and the file."""
    source, description = file_source(
        value, *video_folder(cfg), where,
        "a video must be a path, {'bytes': ...}, bytes or a list of frames")
    try:
        container = av.open(source)
    except (av.FFmpegError, OSError) as error:
        raise ValueError(f"{where}: cannot read video {description}: {error}") from error
    with container:
        if not container.streams.video:
            kinds = ", ".join(stream.type for stream in container.streams) or "none"
            raise ValueError(f"{where}: video {description} has no video stream (its streams: "
                             f"{kinds}): not a video, or the file is truncated or corrupt; "
                             f"{REPLACE}")
        try:
            yield container, container.streams.video[0], description
        except av.FFmpegError as error:
            raise ValueError(f"{where}: cannot decode video {description}: {error}; "
                             f"{REPLACE}") from error


def probe_video(value, cfg: DataConfig, where: str) -> tuple[int, float, tuple[int, int]]:
    """(frames, frames per second, (width, height)) of a videos-column entry, checked at start-up as
    far as it can be without decoding it all. A file: its packets read (not decoded) and counted,
    its first frame decoded; its frame count the container's (the packets' where the container does
    not say), its size its first frame's. A file whose whole packets fall short of that count (cut
    short) or whose first frame does not decode is refused here, not when its row is first drawn;
    decoding every frame kept would cost the start-up about as much as an epoch's reads
    (docs/speed-and-memory.md), so a packet that is whole but does not decode is found when its row
    is read, an error naming the row and the file (read_video). A list of frames: its length,
    --data.video-fps, and the size of the frames kept, one size for all (one_size)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where}: a list of frames with no frames")
        kept = sorted(set(frame_indices(len(value), cfg.video_fps, cfg.video_fps, cfg.max_frames)))
        sizes = {i: open_frame(value[i], cfg, f"{where}, frame {i}").size for i in kept}
        return len(value), cfg.video_fps, one_size(sizes, where)
    with open_video(value, cfg, where) as (container, stream, description):
        whole, first = 0, None  # packets read in full; the first frame
        # its last packet, empty, flushes the decoder's delayed frames
        for packet in container.demux(stream):
            whole += bool(packet.size) and not packet.is_corrupt
            if first is None:
                first = next(iter(packet.decode()), None)
        total = stream.frames or whole
        rate = stream.average_rate or stream.guessed_rate
    if total == 0:
        raise ValueError(f"{where}: video {description} has no frames (an empty file, or one cut "
                         f"short); {REPLACE}")
    if whole < total or first is None:
        raise ValueError(f"{where}: video {description} holds {whole} whole frames of the {total} "
                         f"its container lists" +
                         ("" if first is not None else ", none of which decodes") +
                         f": the file is truncated or corrupt; {REPLACE}")
    if not rate:
        raise ValueError(f"{where}: video {description} does not say its frame rate; give it as a "
                         "list of frames")
    return total, float(rate), (first.width, first.height)


def one_size(sizes: dict[int, tuple[int, int]], where: str) -> tuple[int, int]:
    """The one (width, height) of a video's frames ({frame index: size}); frames of two sizes are
    refused, naming both, rather than stretched to one (which would change one's aspect ratio)."""
    (first, size), *others = sizes.items()
    for index, other in others:
        if other != size:
            raise ValueError(f"{where}: frame {index} is {other[0]} x {other[1]} pixels, frame "
                             f"{first} {size[0]} x {size[1]}: a video's frames must be one size; "
                             "resize them alike (aspect ratio kept) or give them as two videos")
    return size


def read_video(value, cfg: DataConfig, where: str) -> Video:
    """A videos-column entry as the engine and the trainer get it (vision.Video): its frame_indices
    frames, each resized like an image (frames of two sizes are refused: one_size)."""
    total, fps, _ = probe_video(value, cfg, where)
    indices = frame_indices(total, fps, cfg.video_fps, cfg.max_frames)
    if isinstance(value, (list, tuple)):
        frames = {i: open_frame(value[i], cfg, f"{where}, frame {i}")
                  for i in sorted(set(indices))}
    else:
        frames, decoded = {}, 0
        with open_video(value, cfg, where) as (container, stream, description):
            # the frames are numbered from 0
            for decoded, frame in enumerate(container.decode(stream), 1):
                if decoded - 1 in indices:
                    frames[decoded - 1] = frame.to_image()
                if decoded > indices[-1]:
                    break
        if decoded <= indices[-1]:
            raise ValueError(f"{where}: video {description} decodes to {decoded} frames, not the "
                             f"{total} its container lists: the file is corrupt; {REPLACE}")
    width, height = resized_size(*one_size({i: frame.size for i, frame in frames.items()}, where),
                                 cfg.min_pixels, cfg.max_pixels)
    pixels = [frames[i] if frames[i].size == (width, height) else frames[i].resize((width, height))
              for i in indices]
    return Video(np.stack([np.asarray(frame.convert("RGB")) for frame in pixels]),  # [T, H, W, 3]
                 fps, indices, total)


# -------------------------------------------------------- batches: every rank its share


def load_datasets(cfg: DataConfig, tokenizer, processor, say, tools: list[dict] | None = None,
                  open_turn: bool = False) -> tuple[PromptDataset, PromptDataset | None]:
    """The training prompts and the validation prompts (None without validation files); `tools`:
    the JSON schemas of the tools the prompts offer the model (tools.py); `open_turn`:
    PromptDataset's."""
    train_set = PromptDataset(load_rows(cfg.train_files), cfg, tokenizer, cfg.train_files,
                              processor, tools, open_turn)
    # never another dataset by default
    val_files, val_note = validation_files(cfg.train_files, cfg.val_files)
    val_set = (PromptDataset(load_rows(val_files), cfg, tokenizer, val_files, processor, tools,
                             open_turn)
               if val_files else None)
    say(f"data: {len(train_set)} training prompts ({train_set.num_filtered} longer than "
        f"{cfg.max_prompt_length} tokens dropped), {len(val_set) if val_set else 0} validation "
        "prompts; " + val_note)
    return train_set, val_set


class PromptLoader:
    """Endless, seeded, resumable batches of prompts; `next_batch()` gives this rank its share of
    the next one.

    Epoch e visits the prompts in the order random.Random(seed + e).shuffle(range(n)) (the same on
    every rank). A step takes the next batch_size prompts of that order (the global batch) and
    rank r the contiguous slice [r * B/W, (r + 1) * B/W). With n=10, batch_size=4, world_size=2,
    shuffle=False: rank 0 gets items 0,1 then 4,5 then (items 8,9 dropped, epoch 1) 0,1;
    rank 1 gets 2,3 then 6,7 then 2,3.
    """

    def __init__(self, dataset: Sequence, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool):
        if batch_size % world_size:
            raise ValueError(f"the global batch of {batch_size} prompts cannot be split evenly "
                             f"over {world_size} ranks; choose a batch size divisible by the "
                             "number of ranks")
        if len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts (after dropping overlong "
                             f"ones), fewer than one batch of {batch_size}; lower the batch size "
                             "or use a larger dataset")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.per_rank = batch_size // world_size
        self.offset = rank * self.per_rank  # this rank's slice of each global batch
        self.load_state_dict({"epoch": 0, "position": 0})

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[PromptItem]:
        if self.position + self.batch_size > len(self.dataset):  # drop the incomplete last batch
            self.load_state_dict({"epoch": self.epoch + 1, "position": 0})
        start = self.position + self.offset
        self.position += self.batch_size
        return [self.dataset[i] for i in self.order[start : start + self.per_rank]]

    def state_dict(self) -> dict:
        """Where the run stands, in global prompts: the same on every rank, valid for any number of
        ranks."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.order = self._order(self.epoch)


def shard(dataset: Sequence, rank: int, world_size: int) -> list[PromptItem]:
    """This rank's share of a (validation) dataset: items rank, rank + world_size, ...
    (ranks may differ by one)."""
    return [dataset[i] for i in range(rank, len(dataset), world_size)]
