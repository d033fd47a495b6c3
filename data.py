"""Prompt datasets: load `name[@split]`, render every prompt, serve seeded, resumable batches
to each rank.

What a dataset is and holds (where its rows come from, its columns, prompts, images and videos,
TRL's conversational rows): docs/data.md. The files' checks are plumbing/datafiles.py's; decoding
images and videos plumbing/media.py's.

Design decisions:
- Prompts longer than max_prompt_length tokens are dropped at start-up, never truncated (a cut
  prompt is a different question, and a cut inside an image's tokens breaks the model); an image
  counts as the tokens the processor will give it, a video as its container's frame count, rate and
  size give it. The count is kept in `num_filtered` for the trainer to log.
- Images and videos are decoded and resized (min/max pixels) here, once: the engine and the trainer
  get the same pixels. The prompt holds one `<|image_pad|>` per image, the form vLLM expands itself.
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

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import datasets
from datasets.fingerprint import generate_random_fingerprint

from model.vision import Video, image_tokens, placeholder_tokens, video_metadata, video_tokens
from plumbing.datafiles import conversation, load_files
from plumbing.loading import load_template, task_piece
from plumbing.media import (frame_indices, open_image, probe_video, read_video, resize_image,
                            resized_size)

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


# -------------------------------------------------------- rows: built-in tasks, files, folders, hub


def load_rows(spec: str) -> datasets.Dataset:
    """The rows of `name[@split]`: a built-in task's (`NAME` or `NAME:ARGUMENT`: the `rows(split)`
    or `rows(split, ARGUMENT)` of tasks/NAME.py), or a local file or folder's, or a hub dataset's
    (plumbing/datafiles.py)."""
    name, split = parse_spec(spec)
    task, colon, argument = name.partition(":")
    rows = task_piece(task, "rows")
    if rows is None:
        return load_files(spec, name, split)
    split = split or "train"
    return datasets.Dataset.from_list(rows(split, argument) if colon else rows(split))


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
    if task_piece(name.partition(":")[0], "rows") is not None:  # a built-in task's
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
    in the prompt (features/tools.py); `open_turn`: each prompt ends with the user's text, the rest
    of the turn left to the episode (an environment class's reset ends it: features/env.py)."""

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
        messages = conversation(value, self.where(index), self.cfg.prompt_key,
                                {"image": (self.cfg.image_key, self.has_images),
                                 "video": (self.cfg.video_key, self.has_videos)})
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
        videos = [Video(*read_video(value, cfg, self.where(index, video=number)))
                  for number, value in enumerate(row.get(cfg.video_key) or [])]
        prompt = self.prompt(row[cfg.prompt_key], index, len(images), len(videos))
        return PromptItem(prompt=prompt, prompt_ids=self.prompt_ids(prompt),
                          ground_truth=row[cfg.answer_key], row=row, images=images, videos=videos)


# -------------------------------------------------------- batches: every rank its share


def load_datasets(cfg: DataConfig, tokenizer, processor, say, tools: list[dict] | None = None,
                  open_turn: bool = False) -> tuple[PromptDataset, PromptDataset | None]:
    """The training prompts and the validation prompts (None without validation files); `tools`:
    the JSON schemas of the tools the prompts offer the model (features/tools.py); `open_turn`:
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
