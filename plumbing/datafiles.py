"""The data files' checks: a parquet, json, jsonl or csv file, a folder of them, or a Hugging Face Hub dataset read
with `datasets`, and what `datasets` would read wrongly or report in its own terms refused, naming the file, the line
and the column (data.py's load_rows hands over every name that is not a built-in task); and a prompt column's value
read as messages, TRL's conversational form checked (data.PromptDataset renders them)."""

import codecs
import json
from collections.abc import Mapping
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet

FILE_TYPES = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def load_files(spec: str, name: str, split: str | None) -> datasets.Dataset:
    """The rows of `spec` (`name[@split]`, parsed): a local file (the file is the split), a folder of files split by
    file name (train.jsonl, test-0000.parquet), or a hub dataset id."""
    path = Path(name).expanduser()
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


# ---------------------------------------------------------------------------------------------------- prompts


def conversation(value, where: str, prompt_key: str, columns: dict[str, tuple[str, bool]]) -> list[dict]:
    """A prompt column's value as messages of text, their images and videos marked `<image>`
    and `<video>`: text is one user message; TRL's conversational form, a list of
    {"role", "content"} messages (system, user, assistant: the last the user's, or the
    assistant's to continue), each content text or a list of parts ({"type": "text", "text":
    ...}, {"type": "image"}, {"type": "video"}), is the conversation as it is.

    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    -> [{"role": "user", "content": "<image>Colour?"}]
    `where` names the row in the errors; `columns`: each kind of media, image and video -> (its column, whether the
    dataset has it).
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(message, Mapping) for message in value)):
        raise ValueError(f"{where}: column {prompt_key!r} must hold text or a list of "
                         "messages ({'role': ..., 'content': ...}, TRL's conversational "
                         f"form), got {type(value).__name__} {value!r:.80}")
    messages = []
    for number, message in enumerate(value):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}, message {number}: needs a 'role' (system, user or "
                             f"assistant), got {role!r:.40}")
        if isinstance(content, (list, tuple)):
            content = "".join(message_part(part, f"{where}, message {number}, part {p}", columns)
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


def message_part(part, where: str, columns: dict[str, tuple[str, bool]]) -> str:
    """One part of a message's content as text: a text part's text, an image (video) part
    `<image>` (`<video>`), whose image is the row's next of its images column."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    for media, (key, present) in columns.items():
        flag = f"--data.{media}-key"
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
