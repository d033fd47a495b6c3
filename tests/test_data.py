"""data.py: loading files, folders and the toy task, prompt rendering, clear errors, and the resumable loader."""

import io
import json
import re
import sys

import av
import datasets
import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from conftest import stripes, write_video
from data import DataConfig, PromptDataset, PromptLoader, load_rows, shard, validation_files
from plumbing.media import frame_indices, resize_image, resized_size
from tasks.reasoning_gym import task as reasoning_gym_task
from tasks.toy import rows as toy_rows
from tasks.toy_motion import rows as toy_motion_rows
from plumbing.tiny import build_tiny_model, build_tokenizer

MATH_SUFFIX = (" You first think about the reasoning process as an internal monologue and then provide the final"
               " answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer"
               " MUST BE put in \\boxed{}.")
ROWS = [
    {"question": "What is 2 + 3?", "solution": "5", "source": "arith"},
    {"question": "  What is 7 * 6?\n", "solution": "42", "source": "arith"},
    {"question": "Name the first prime.", "solution": "2", "source": "primes"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def custom_keys(**overrides) -> DataConfig:
    return DataConfig(prompt_key="question", answer_key="solution", **overrides)


# ---------------------------------------------------------------- loading and rendering


def test_toy_rows():
    train, test = toy_rows("train"), toy_rows("test")
    assert len(train) == 1024 and train == toy_rows("train")  # seeded
    assert {row["answer"] for row in train} == {str(d) for d in range(10)}
    assert len(test) == 50 and test[0] == {"problem": "2221512", "answer": "2"}
    for row in train + test:  # 7 digits, the answer 4 times, no other digit as often
        digits = row["problem"]
        assert len(digits) == 7 and digits.count(row["answer"]) == 4
        assert all(digits.count(d) < 4 for d in digits if d != row["answer"])
    with pytest.raises(ValueError, match="'validation'"):
        toy_rows("validation")


def test_toy_dataset_item(tokenizer):
    dataset = PromptDataset(load_rows("toy@test"), DataConfig(), tokenizer, "toy@test")
    item = dataset[0]
    assert item["prompt"] == chat("2221512")
    assert tokenizer.decode(item["prompt_ids"]) == item["prompt"]
    assert item["prompt_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert (item["ground_truth"], item["row"], item["images"]) == ("2", {"problem": "2221512", "answer": "2"}, [])
    assert len(dataset) == 50 and dataset.num_filtered == 0
    assert len(load_rows("toy")) == 1024


def test_parquet_custom_keys_and_format_prompt(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    monkeypatch.chdir(tmp_path)  # templates/math.jinja is found next to data.py from any directory
    cfg = custom_keys(format_prompt="templates/math.jinja", max_prompt_length=1000)
    dataset = PromptDataset(load_rows(str(path)), cfg, tokenizer, str(path))
    assert len(dataset) == 3
    item = dataset[1]
    assert item["prompt"] == chat("What is 7 * 6?" + MATH_SUFFIX)  # `| trim` strips the prompt
    assert tokenizer.decode(item["prompt_ids"]) == item["prompt"]
    assert item["ground_truth"] == "42"
    assert item["row"] == ROWS[1] and item["images"] == []


def test_jsonl_answers_of_any_type(tmp_path, tokenizer):
    rows = [{"question": "sum?", "solution": 5, "meta": {"level": 1}},
            {"question": "roots?", "solution": [1, 2], "meta": {"level": 3}}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    dataset = PromptDataset(load_rows(str(path)), custom_keys(), tokenizer, "data")
    assert [dataset[i]["ground_truth"] for i in range(2)] == [5, [1, 2]]
    assert dataset[1]["row"] == rows[1]
    assert dataset[0]["prompt"] == chat("sum?")


def test_string_answers_reach_the_grader_exactly_as_written(tmp_path, tokenizer):
    """Answers an exact-match grader compares character by character: leading zeros, trailing zeros, JSON-looking
    text stay strings as written."""
    answers = ["007", "1.50", "true", "[1]", "null", "3"]
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": "?", "solution": a} for a in answers])
    dataset = PromptDataset(load_rows(str(path)), custom_keys(), tokenizer, "data")
    assert [dataset[i]["ground_truth"] for i in range(len(answers))] == answers


def test_a_column_of_strings_beside_other_types_is_refused_naming_file_column_and_lines(tmp_path):
    """`datasets` types such a column as JSON and reads each string as JSON ("007" -> 7): refused, not changed."""
    rows = [{"question": "a", "solution": "007"}, {"question": "b", "solution": 5},
            {"question": "c", "solution": "1.50"}, {"question": "d", "solution": {"x": 1}}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(ValueError, match=re.escape(f"dataset file {path}: column 'solution' holds a string on line 1, "
                                                   "a number on line 2, an object on line 4;")):
        load_rows(str(path))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows[:2])
    with pytest.raises(ValueError, match="train.jsonl: column 'solution' holds a string on line 1, a number on line 2"):
        load_rows(str(folder))
    other_types = write_jsonl(tmp_path / "numbers.jsonl", [rows[1], rows[3]])  # no string to change: kept
    assert load_rows(str(other_types))["solution"] == [5, {"x": 1}]


@pytest.mark.parametrize("values, where", [
    (["007", 0], "a string on line 1, a number on line 2"),
    (["007", False], "a string on line 1, a boolean on line 2"),
    (["1.50", 0.0], "a string on line 1, a number on line 2"),
    ([5, ""], "a number on line 1, a string on line 2"),
])
def test_a_falsy_value_beside_strings_counts_as_its_type(tmp_path, values, where):
    """0, false, 0.0 and "" are values of their types like any other: a column of strings with one of them on a line
    is typed as JSON by `datasets` (which would read "007" as 7) and refused, naming both lines."""
    path = write_jsonl(tmp_path / "data.jsonl", [{"question": "?", "solution": value} for value in values])
    with pytest.raises(ValueError, match=re.escape(f"column 'solution' holds {where};")):
        load_rows(str(path))

def test_r1v_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS[:1])
    cfg = custom_keys(format_prompt="templates/r1v.jinja", max_prompt_length=1000)
    prompt = PromptDataset(load_rows(str(path)), cfg, tokenizer, "data")[0]["prompt"]
    assert prompt.startswith("<|im_start|>user\nWhat is 2 + 3? A conversation between User and Assistant.")
    assert prompt.endswith("<think> reasoning process here </think><answer> answer here </answer><|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_folder_and_splits(tmp_path):
    folder = tmp_path / "math"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", ROWS)
    write_jsonl(folder / "test.jsonl", ROWS[:1])
    assert len(load_rows(str(folder))) == 3  # split defaults to train
    assert load_rows(f"{folder}@test")["question"] == [ROWS[0]["question"]]
    with pytest.raises(ValueError, match="validation") as error:
        load_rows(f"{folder}@validation")
    assert str(folder) in str(error.value)


def test_validation_comes_from_the_training_data_or_nowhere(tmp_path):
    folder, lone = tmp_path / "math", tmp_path / "lone"
    folder.mkdir(), lone.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        write_jsonl(folder / name, ROWS)
    write_jsonl(lone / "train.jsonl", ROWS)
    assert validation_files("toy", "auto")[0] == "toy@test"
    assert validation_files("toy_vision@train", "auto")[0] == "toy_vision@test"
    assert validation_files(str(folder), "auto") == (f"{folder}@test", f"validation: {folder}@test, the test split of "
                                                     "the training data")
    assert validation_files(str(lone), "auto") == ("", f"no validation: {lone} has no test or validation split to hold "
                                                   "out (--data.val-files to give one)")
    assert validation_files(str(lone / "train.jsonl"), "auto")[1].endswith("is a single file, which has no test split "
                                                                           "(--data.val-files to give one)")
    assert validation_files("toy", "") == ("", "no validation (--data.val-files is empty)")
    assert validation_files("toy", "mine.jsonl") == ("mine.jsonl", "validation: mine.jsonl")


def test_file_faults_are_named_with_where_they_are(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "ok", "answer": "1"}\n{"question": "\xff", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl is not UTF-8 text: byte 0xff at offset 48 \(line 2\)"):
        load_rows(str(bad))
    bad.write_text('{"question": "ok", "answer": "1"}\n\n{"question": oops}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 3: not JSON"):
        load_rows(str(bad))
    bad.write_text(" \n")
    with pytest.raises(ValueError, match="bad.jsonl is empty"):
        load_rows(str(bad))


def test_a_single_file_is_its_split(tmp_path):
    path = write_jsonl(tmp_path / "val.jsonl", ROWS)
    assert len(load_rows(str(path))) == 3
    with pytest.raises(ValueError, match="drop '@test'"):
        load_rows(f"{path}@test")


# ---------------------------------------------------------------- reasoning-gym's generated tasks


LEGS = {"grasshopper": 6, "jellyfish": 0, "tiger": 4, "scorpion": 8, "spider": 8, "wasp": 6, "praying mantis": 6,
        "crab": 10, "woodlouse": 14}


def test_a_reasoning_gym_task_is_two_splits_of_rows_the_task_generates_from_far_apart_seeds():
    """reasoning_gym:leg_counting: 2,048 train rows from seed 0 and 128 test rows from seed 1,000,000, each the task's
    own question and answer with where it comes from; no test question is a train question (with seed 1, all 128
    would be: the task draws row i from Random(seed + i))."""
    import reasoning_gym

    train, test = load_rows("reasoning_gym:leg_counting"), load_rows("reasoning_gym:leg_counting@test")
    assert (len(train), len(test)) == (2048, 128)
    first = train[0]
    assert first["answer"] == "500" and first["reasoning_gym"] == {"dataset": "leg_counting", "seed": 0, "size": 2048,
                                                                   "index": 0}
    animals = re.findall(r"(\d+) ([a-z ]+?)s?[,?]", first["problem"])  # "5 grasshoppers, 8 jellyfishs, ..."
    assert len(animals) == 9 and sum(int(count) * LEGS[animal] for count, animal in animals) == 500  # 30 + 0 + ... + 42
    made = reasoning_gym.create_dataset("leg_counting", seed=1_000_000, size=128)[127]
    assert test[127] == {"problem": made["question"], "answer": made["answer"],
                         "reasoning_gym": {"dataset": "leg_counting", "seed": 1_000_000, "size": 128, "index": 127}}
    assert not set(test["problem"]) & set(train["problem"])
    with pytest.raises(ValueError, match="has the splits 'train' and 'test', not 'validation'"):
        load_rows("reasoning_gym:leg_counting@validation")


def test_a_reasoning_gym_task_validates_on_its_test_split_rendered_like_any_prompt(tokenizer):
    assert validation_files("reasoning_gym:leg_counting", "auto") == (
        "reasoning_gym:leg_counting@test",
        "validation: reasoning_gym:leg_counting@test, the test split of the training data")
    dataset = PromptDataset(load_rows("reasoning_gym:leg_counting@test"), DataConfig(max_prompt_length=384), tokenizer,
                            "reasoning_gym:leg_counting@test")
    assert len(dataset) == 128 and dataset.num_filtered == 0  # questions of 159 to 271 characters, one token each
    item = dataset[0]
    assert item["prompt"] == chat(item["row"]["problem"]) and item["ground_truth"] == item["row"]["answer"] == "134"


def test_an_unknown_reasoning_gym_task_names_the_flag_and_the_close_names():
    with pytest.raises(ValueError) as error:
        load_rows("reasoning_gym:leg_count")
    assert str(error.value).startswith("--data.train-files (or --data.val-files) reasoning_gym:leg_count: "
                                       "reasoning-gym has no task 'leg_count'; close names: leg_counting, ")
    with pytest.raises(ValueError, match="close names: basic_arithmetic, .*; all 106: python -c"):
        load_rows("reasoning_gym:arithmetic")
    with pytest.raises(ValueError, match="cannot make 'composite' at its default settings .*; choose another task"):
        load_rows("reasoning_gym:composite")  # a mix of tasks, which needs a config


def test_a_reasoning_gym_task_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    reasoning_gym_task.cache_clear()  # a task made by an earlier test would not import it again
    with pytest.raises(ValueError) as error:
        load_rows("reasoning_gym:leg_counting")
    assert str(error.value) == "dataset reasoning_gym:leg_counting needs reasoning-gym: pip install reasoning-gym"


# ---------------------------------------------------------------- image datasets (a tiny Qwen2-VL's processor)


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return AutoProcessor.from_pretrained(build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("vlm") / "qwen2_vl"))


def png(size, colour=(255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def test_image_rows_every_image_form_placeholders_in_order_and_mixed_rows(tmp_path, processor):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png((56, 28), (0, 255, 0)))
    cfg = DataConfig(image_dir=str(tmp_path / "img"), min_pixels=28 * 28, max_pixels=56 * 56)
    forms = {  # a column holds one form: PIL images (an image feature), {"bytes": ...}, raw bytes, relative paths
        "pil": [Image.new("RGB", (28, 28), (255, 0, 0)), Image.new("RGB", (28, 56))],
        "dicts": [{"bytes": png((28, 28), (255, 0, 0))}, {"bytes": png((28, 56))}],
        "bytes": [png((28, 28), (255, 0, 0)), png((28, 56))],
        "paths": ["a.png", str(tmp_path / "img" / "a.png")],
    }
    for form, images in forms.items():
        rows = [{"problem": "<image>left, <image>right: same?", "answer": "no", "images": images},
                {"problem": "text only", "answer": "1", "images": []}]
        dataset = PromptDataset(datasets.Dataset.from_list(rows), cfg, processor.tokenizer, form, processor)
        assert [dataset[i]["prompt"] for i in range(2)] == [chat(f"{VISION}left, {VISION}right: same?"),
                                                            chat("text only")]
        first, second = dataset[0]["images"]
        assert first.mode == "RGB" and dataset[1]["images"] == []
        assert (first.size, second.size) == (((56, 28), (56, 28)) if form == "paths" else ((28, 28), (28, 56))), form
        assert first.getpixel((0, 0)) == ((0, 255, 0) if form == "paths" else (255, 0, 0)), form
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert dataset[0]["prompt_ids"].count(pad) == 2  # one per image: vLLM expands each itself


def test_the_resize_rule_and_its_use_in_both_directions():
    assert resized_size(400, 300, min_pixels=100, max_pixels=30_000) == (200, 150)  # scale sqrt(30000 / 120000)
    assert resized_size(20, 10, min_pixels=800, max_pixels=30_000) == (40, 20)  # scale sqrt(800 / 200)
    assert resized_size(100, 100, min_pixels=100, max_pixels=30_000) == (100, 100)
    image = resize_image(Image.new("L", (400, 300)), min_pixels=100, max_pixels=30_000)
    assert image.size == (200, 150) and image.mode == "RGB"


def test_image_tokens_count_against_the_prompt_length(tmp_path, processor):
    """A 56 x 56 image is 4 x 4 patches, 4 tokens after the 2 x 2 merge; a 112 x 112 one 16: the limit that
    keeps the text and a small image drops the same text with a large one."""
    text_tokens = len(processor.tokenizer(chat(VISION + "x"), add_special_tokens=False).input_ids)
    rows = [{"problem": "<image>x", "answer": str(side), "images": [png((side, side))]} for side in (56, 112)]
    limit = text_tokens - 1 + 4
    cfg = DataConfig(max_prompt_length=limit, min_pixels=28 * 28, max_pixels=112 * 112)
    dataset = PromptDataset(datasets.Dataset.from_list(rows), cfg, processor.tokenizer, "sizes", processor)
    assert dataset.num_filtered == 1 and dataset[0]["ground_truth"] == "56"
    inputs = processor(text=[dataset[0]["prompt"]], images=dataset[0]["images"])
    assert len(inputs["input_ids"][0]) == limit  # the processor's expansion is what was counted
    with pytest.raises(ValueError, match="raise --data.max-prompt-length or lower --data.max-pixels"):
        PromptDataset(datasets.Dataset.from_list(rows), DataConfig(max_prompt_length=limit - 1, min_pixels=28 * 28,
                      max_pixels=112 * 112), processor.tokenizer, "sizes", processor)


@pytest.mark.parametrize("row, message", [
    ({"problem": "<image><image>", "images": [png((28, 28))]}, "row 0: 2 <image> placeholders for 1 images"),
    ({"problem": "no placeholder", "images": [png((28, 28))]}, "row 0: 0 <image> placeholders for 1 images"),
    ({"problem": "<image>", "images": ["missing.png"]}, "row 0, image 0: cannot read image file .*missing.png"),
    ({"problem": "<image>", "images": [b"not an image"]}, "row 0, image 0: cannot read image 12 bytes"),
    ({"problem": "<image>", "images": [[1, 2]]}, "row 0, image 0: an image must be a PIL image"),
])
def test_image_row_errors_name_the_row(processor, row, message):
    rows = datasets.Dataset.from_list([{**row, "answer": "1"}])
    with pytest.raises(ValueError, match=f"'bad', {message}"):
        PromptDataset(rows, DataConfig(), processor.tokenizer, "bad", processor)


def test_image_rows_need_a_vision_language_model(tokenizer):
    rows = datasets.Dataset.from_list([{"problem": "<image>", "answer": "1", "images": [png((28, 28))]}])
    with pytest.raises(ValueError, match="row 0 has images, but the model has no processor"):
        PromptDataset(rows, DataConfig(), tokenizer, "vqa")


# ---------------------------------------------------------------- TRL's conversational datasets

SYSTEM = {"role": "system", "content": "Answer with a number."}
CONVERSATIONS = [  # TRL's conversational prompt-only rows: a system message, several turns, a prefill
    [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "What is 7 * 6?"}],
    [{"role": "user", "content": "Name the first prime."}, {"role": "assistant", "content": "It is"}],
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_trl_conversational_prompts_render_as_trls_chat_template_does(tmp_path, tokenizer, suffix):
    """TRL's `maybe_apply_chat_template`: the conversation with the generation prompt, or, after a last assistant
    message, that message continued; the answer column, whatever its name, untouched."""
    rows = [{"prompt": prompt, "solution": answer} for prompt, answer in zip(CONVERSATIONS, ["5", "42", "2"])]
    path = tmp_path / f"trl{suffix}"
    write_jsonl(path, rows) if suffix == ".jsonl" else datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = DataConfig(prompt_key="prompt", answer_key="solution", max_prompt_length=1000)
    dataset = PromptDataset(load_rows(str(path)), cfg, tokenizer, "trl")
    assert [dataset[i]["prompt"] for i in range(3)] == [
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n" + chat("What is 2 + 3?"),
        tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True),
        chat("Name the first prime.") + "It is"]
    assert dataset[1]["prompt"].endswith(chat("What is 7 * 6?"))
    assert (dataset[0]["ground_truth"], dataset[0]["row"]) == ("5", rows[0])
    assert tokenizer.decode(dataset[2]["prompt_ids"]) == dataset[2]["prompt"]


def test_a_format_prompt_renders_a_conversations_last_user_message(tmp_path, tokenizer):
    rows = [{"prompt": CONVERSATIONS[1], "answer": "42"}]
    cfg = DataConfig(prompt_key="prompt", format_prompt="templates/math.jinja", max_prompt_length=1000)
    prompt = PromptDataset(datasets.Dataset.from_list(rows), cfg, tokenizer, "trl")[0]["prompt"]
    assert prompt.startswith("<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    assert prompt.endswith(chat("What is 7 * 6?" + MATH_SUFFIX))


def test_trl_vision_rows_images_in_parts_or_before_the_first_user_text(tmp_path, processor):
    """TRL's VLM form: {"type": "image"} parts, the images in the `images` column (parquet: every content a list of
    parts); a conversation of text only gets its images at the start of its first user message (TRL's
    prepare_multimodal_messages); text rows mix in."""
    def text(value):
        return {"type": "text", "text": value}

    system = {"role": "system", "content": [text("Answer with a number.")]}
    parts = [{"type": "image"}, text("left, "), {"type": "image"}, text("right")]
    rows = [{"prompt": [system, {"role": "user", "content": parts}], "answer": "no",
             "images": [{"bytes": png((28, 28))}, {"bytes": png((28, 56))}]},
            {"prompt": [{"role": "user", "content": [text("2 + 3?")]}], "answer": "5", "images": []}]
    path = tmp_path / "vlm.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))  # the image parts come back with "text": None
    cfg = DataConfig(prompt_key="prompt", min_pixels=28 * 28, max_pixels=56 * 56, image_dir=str(tmp_path))
    dataset = PromptDataset(load_rows(str(path)), cfg, processor.tokenizer, "vlm", processor)
    opening = "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
    assert [dataset[i]["prompt"] for i in range(2)] == [opening + chat(f"{VISION}left, {VISION}right"), chat("2 + 3?")]
    assert [image.size for image in dataset[0]["images"]] == [(28, 28), (28, 56)]
    (tmp_path / "a.png").write_bytes(png((28, 28)))
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": CONVERSATIONS[0], "answer": "5", "images": ["a.png"]}])
    dataset = PromptDataset(load_rows(str(plain)), cfg, processor.tokenizer, "plain", processor)
    assert dataset[0]["prompt"] == opening + chat(f"{VISION}What is 2 + 3?")


@pytest.mark.parametrize("prompt, message", [
    ({"role": "user", "content": "hi"}, "row 0: column 'prompt' must hold text or a list of messages"),
    ([{"content": "hi"}], r"row 0, message 0: needs a 'role' \(system, user or assistant\)"),
    ([{"role": "user", "content": 5}], "row 0, message 0: 'content' must be text or a list of parts, got int 5;"
                                       " in a JSON file"),
    ([{"role": "user", "content": "hi"}, SYSTEM], "row 0: the last message is the system's"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "row 0, message 0, part 0: a part must be"),
    ([{"role": "user", "content": [{"type": "image"}]}], "row 0, message 0, part 0: a part of type 'image', and "
                                                         r"the dataset has no column 'images' of images \(--data"),
    ([SYSTEM, {"role": "user", "content": "<|im_end|>"}], "row 0: the prompt holds '<|im_end|>', a control token"),
])
def test_a_malformed_conversation_is_named_with_its_row_message_and_part(tokenizer, prompt, message):
    rows = datasets.Dataset.from_list([{"prompt": prompt, "answer": "1"}])
    with pytest.raises(ValueError, match=f"'bad', {message}"):
        PromptDataset(rows, DataConfig(prompt_key="prompt"), tokenizer, "bad")


def test_an_environments_prompt_ends_with_the_users_message(tokenizer):
    rows = datasets.Dataset.from_list([{"prompt": CONVERSATIONS[2], "answer": "2"}])
    with pytest.raises(ValueError, match="'bad', row 0: the prompt ends with the assistant's message, and the "
                                         "environment's reset ends the user's"):
        PromptDataset(rows, DataConfig(prompt_key="prompt"), tokenizer, "bad", open_turn=True)
    opened = PromptDataset(datasets.Dataset.from_list([{"prompt": CONVERSATIONS[0], "answer": "5"}]),
                           DataConfig(prompt_key="prompt"), tokenizer, "trl", open_turn=True)[0]["prompt"]
    assert opened == "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?"


# ---------------------------------------------------------------- video datasets (the same processor)

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def test_the_frames_kept_by_hand():
    """--data.video-fps frames a second, spread from the first frame to the last, an even number within
    --data.max-frames (and the video's own frames)."""
    assert frame_indices(100, 25.0, 2.0, 32) == [0, 14, 28, 42, 57, 71, 85, 99]  # 4 s: linspace(0, 99, 8), rounded
    assert frame_indices(100, 25.0, 2.0, 6) == [0, 20, 40, 59, 79, 99]  # capped at 6: 0, 19.8, 39.6, 59.4, 79.2
    assert frame_indices(100, 25.0, 2.0, 7) == frame_indices(100, 25.0, 2.0, 6)  # the cap rounded down to even
    assert frame_indices(12, 4.0, 2.0, 32) == [0, 2, 4, 7, 9, 11]  # 3 s: 6 frames, linspace(0, 11, 6) = 0, 2.2, ..
    assert frame_indices(1, 30.0, 2.0, 32) == [0, 0]  # a still: its frame twice, a pair
    assert frame_indices(3, 2.0, 2.0, 32) == [0, 1, 1, 2]  # 3 frames as 4: 0, 0.67, 1.33, 2


def test_video_rows_every_form_beside_image_and_text_rows(tmp_path, processor):
    """Video files (relative to --data.video-dir, absolute, {"bytes": ...}) and frame lists (images, paths), each in a
    dataset of video, image-and-video and text rows: every `<video>` rendered where it stands with one
    `<|video_pad|>`, the frames kept (2 a second, at most 4) resized like images, and where they come from."""
    clips = tmp_path / "clips"
    clips.mkdir()
    frames = stripes(12)  # 12 frames at 4 a second: 3 s
    file = write_video(clips / "a.mp4", frames, fps=4)
    for t in range(4):
        Image.fromarray(frames[t]).save(clips / f"f{t}.png")
    listed = [Image.fromarray(frame) for frame in frames[:4]]
    cfg = DataConfig(video_dir=str(clips), image_dir=str(tmp_path), video_fps=2.0, max_frames=4, min_pixels=28 * 28,
                     max_pixels=28 * 56)
    forms = {"paths": ["a.mp4", str(file)], "bytes": [{"bytes": file.read_bytes()}] * 2,
             "frames": [listed, listed], "frame paths": [[f"f{t}.png" for t in range(4)]] * 2}
    for form, videos in forms.items():
        rows = [{"problem": "<video>first, <video>second?", "answer": "r", "images": [], "videos": videos},
                {"problem": "<image>and <video>", "answer": "r", "images": [png((28, 28))], "videos": videos[:1]},
                {"problem": "text only", "answer": "1", "images": [], "videos": []}]
        dataset = PromptDataset(datasets.Dataset.from_list(rows), cfg, processor.tokenizer, form, processor)
        assert [dataset[i]["prompt"] for i in range(3)] == [chat(f"{VIDEO}first, {VIDEO}second?"),
                                                            chat(f"{VISION}and {VIDEO}"), chat("text only")]
        video = dataset[0]["videos"][0]
        assert dataset[0]["prompt_ids"].count(processor.video_token_id) == 2  # vLLM expands each itself
        assert len(dataset[1]["videos"]) == 1 and dataset[2]["videos"] == [] and len(dataset[1]["images"]) == 1
        assert video.frames.shape == (4, 39, 39, 3) and video.frames.dtype == np.uint8  # 56 x 56 scaled to 1,568 px
        if form in ("paths", "bytes"):  # 3 s at 2 a second is 6 frames, 4 at most: frames 0, 3.67, 7.33, 11
            assert (video.fps, video.indices, video.total) == (4.0, [0, 4, 7, 11], 12)
            band = video.frames[1].mean(axis=(0, 2))  # frame 4's bright band is at 28..35 of 56: 19.5..24.4 of 39
            assert band[21] > 200 and band[5] < 100, band
        else:  # a list of frames is taken as sampled at --data.video-fps
            assert (video.fps, video.indices, video.total) == (2.0, [0, 1, 2, 3], 4)
            assert np.array_equal(video.frames[2], np.asarray(listed[2].resize((39, 39))))


def test_video_tokens_count_against_the_prompt_length(processor):
    """A 56 x 56 frame is 4 x 4 patches and a pair of frames 4 tokens after the 2 x 2 merge: a 4-frame video is 8
    tokens, an 8-frame one 16. The limit that keeps the text and the short video drops the long one, and what was
    counted is the processor's own expansion."""
    text_tokens = len(processor.tokenizer(chat(VIDEO + "x"), add_special_tokens=False).input_ids)
    rows = [{"problem": "<video>x", "answer": str(count), "videos": [[png((56, 56))] * count]} for count in (4, 8)]
    limit = text_tokens - 1 + 8
    cfg = DataConfig(max_prompt_length=limit, video_fps=2.0, max_frames=8, min_pixels=28 * 28, max_pixels=56 * 56)
    dataset = PromptDataset(datasets.Dataset.from_list(rows), cfg, processor.tokenizer, "lengths", processor)
    assert dataset.num_filtered == 1 and dataset[0]["ground_truth"] == "4"
    video = dataset[0]["videos"][0]
    inputs = processor(text=[dataset[0]["prompt"]], videos=[video.frames], video_metadata=[video.metadata()],
                       do_sample_frames=False)
    assert len(inputs["input_ids"][0]) == limit
    with pytest.raises(ValueError, match="raise --data.max-prompt-length or lower --data.max-pixels or --data.max-fr"):
        PromptDataset(datasets.Dataset.from_list(rows), DataConfig(**{**vars(cfg), "max_prompt_length": limit - 1}),
                      processor.tokenizer, "lengths", processor)


def empty_video(path):
    """A video file with a video stream and no frames (PyAV writes the header on its own only with the first)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuvj420p"
        container.start_encoding()
    return path


def packets(path) -> list[int]:
    """Where each frame's packet of a video file starts."""
    with av.open(str(path)) as container:
        return [packet.pos for packet in container.demux(container.streams.video[0]) if packet.size]


def cut_video(path):
    """A video file whose container lists 10 frames and holds 6 (cut at the seventh frame's packet)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuvj420p"
        for frame in stripes(10):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    path.write_bytes(path.read_bytes()[:packets(path)[6]])
    return path


def damaged_mp4s(folder):
    """12-frame mp4 files with their index first (as streamed files are), damaged: cut in the index (no stream
    described yet), cut at the seventh frame's packet, every frame's bytes zeroed, the seventh frame's zeroed."""
    whole = folder / "whole.mp4"
    with av.open(str(whole), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for frame in stripes(12):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    data, starts = whole.read_bytes(), packets(whole)
    (folder / "index-cut.mp4").write_bytes(data[:data.index(b"trak") - 4])  # the moov box up to its first track
    (folder / "frames-cut.mp4").write_bytes(data[:starts[6]])
    (folder / "zeroed.mp4").write_bytes(data[:starts[0]] + bytes(len(data) - starts[0]))
    (folder / "seventh-zeroed.mp4").write_bytes(data[:starts[6]] + bytes(starts[7] - starts[6]) + data[starts[7]:])


FRAMES = [png((28, 28))] * 2
TRUNCATED = "the file is truncated or corrupt; re-encode it \\(ffmpeg -i IN OUT\\)"


@pytest.mark.parametrize("row, message", [
    ({"problem": "<video><video>", "videos": [FRAMES]}, "row 0: 2 <video> placeholders for 1 videos"),
    ({"problem": "no placeholder", "videos": [FRAMES]}, "row 0: 0 <video> placeholders for 1 videos"),
    ({"problem": "<video>", "videos": ["missing.mp4"]}, "row 0, video 0: cannot read video file .*missing.mp4"),
    ({"problem": "<video>", "videos": [{"bytes": b"not a video"}]}, "row 0, video 0: cannot read video 11 bytes"),
    ({"problem": "<video>", "videos": ["empty.avi"]},
     "row 0, video 0: video file .*empty.avi' \\(--data.video-dir .*\\) has no frames"),
    ({"problem": "<video>", "videos": ["index-cut.mp4"]},
     f"row 0, video 0: video file .*index-cut.mp4' .* has no video stream \\(its streams: none\\): not a video, "
     f"or {TRUNCATED}"),
    ({"problem": "<video>", "videos": ["frames-cut.mp4"]},
     f"row 0, video 0: video file .*frames-cut.mp4' .* holds 6 whole frames of the 12 its container lists: "
     f"{TRUNCATED}"),
    ({"problem": "<video>", "videos": ["cut.avi"]},
     f"row 0, video 0: video file .*cut.avi' .* holds 6 whole frames of the 10 its container lists: {TRUNCATED}"),
    ({"problem": "<video>", "videos": ["zeroed.mp4"]},
     "row 0, video 0: cannot decode video file .*zeroed.mp4' .*: .*Invalid data found.*; re-encode it"),
    ({"problem": "<video>", "videos": [[]]}, "row 0, video 0: a list of frames with no frames"),
    ({"problem": "<video>", "videos": [[b"not an image"]]}, "row 0, video 0, frame 0: cannot read image 12 bytes"),
    ({"problem": "<video>", "videos": [[png((28, 28)), png((56, 28)), png((28, 28)), png((28, 28))]]},
     "row 0, video 0: frame 1 is 56 x 28 pixels, frame 0 28 x 28: a video's frames must be one size"),
    ({"problem": "<video>", "videos": "clip.mp4"}, "row 0: column 'videos' must hold a list of videos"),
])
def test_video_row_errors_name_the_row_and_the_file(tmp_path, processor, row, message):
    """Every one found at start-up (the prompt-length check): a file cut short, one that does not decode, frames of
    two sizes too, before any row is drawn."""
    empty_video(tmp_path / "empty.avi")
    cut_video(tmp_path / "cut.avi")
    damaged_mp4s(tmp_path)
    rows = datasets.Dataset.from_list([{**row, "answer": "1"}])
    with pytest.raises(ValueError, match=f"'bad', {message}"):
        PromptDataset(rows, DataConfig(video_dir=str(tmp_path)), processor.tokenizer, "bad", processor)


def test_a_frame_that_does_not_decode_after_the_first_is_named_when_read(tmp_path, processor):
    """The start-up check reads every packet and decodes the first frame; a whole packet later in the file that does
    not decode is found when the row is read, an error naming the row and the file."""
    damaged_mp4s(tmp_path)
    rows = datasets.Dataset.from_list([{"problem": "<video>", "answer": "1", "videos": ["seventh-zeroed.mp4"]}])
    dataset = PromptDataset(rows, DataConfig(video_dir=str(tmp_path), video_fps=4.0, min_pixels=28 * 28,
                                             max_pixels=56 * 56), processor.tokenizer, "zeroed", processor)
    with pytest.raises(ValueError, match="row 0, video 0: cannot decode video file .*seventh-zeroed.mp4' .*: .*Invalid "
                                         "data found"):
        dataset[0]


def test_video_rows_need_a_vision_language_model(tokenizer):
    rows = datasets.Dataset.from_list([{"problem": "<video>", "answer": "1", "videos": [FRAMES]}])
    with pytest.raises(ValueError, match="row 0 has videos, but the model has no processor: video rows need a "
                                         "vision-language model"):
        PromptDataset(rows, DataConfig(), tokenizer, "clips")


def test_the_motion_task_needs_more_than_one_frame():
    """toy_motion: over the rows, the bar's place in any one frame is spread the same way for both answers (so one
    frame cannot tell them apart), and it steps one place a frame in the answer's direction."""
    rows = toy_motion_rows("train")
    assert len(rows) == 1024 and toy_motion_rows("test")[0]["answer"] == "l"
    places = {"l": np.zeros((4, 8)), "r": np.zeros((4, 8))}
    for row in rows:
        frames = [np.asarray(frame)[0, :, 0] > 0 for frame in row["videos"][0]]  # the first row of pixels, red
        where = [next(p for p in range(8) if frames[t][(7 * p + np.arange(14)) % 56].all()) for t in range(4)]
        assert all(frame.sum() == 14 for frame in frames)
        step = 1 if row["answer"] == "r" else -1
        assert all((b - a) % 8 == step % 8 for a, b in zip(where, where[1:])), (row["answer"], where)
        for t, place in enumerate(where):
            places[row["answer"]][t, place] += 1
    for answer, counts in places.items():  # every place about equally often in every frame, either way
        shares = counts / counts.sum(axis=1, keepdims=True)
        assert np.abs(shares - 1 / 8).max() < 0.06, (answer, shares.round(3))


def test_overlong_prompts_are_dropped(tmp_path, tokenizer):
    rows = [{"question": "x" * length, "solution": str(length)} for length in (5, 50, 10, 80)]
    rows_ = load_rows(str(write_jsonl(tmp_path / "lengths.jsonl", rows)))
    overhead = len(tokenizer(chat(""), add_special_tokens=False).input_ids)  # + 1 token per character
    dataset = PromptDataset(rows_, custom_keys(max_prompt_length=overhead + 10), tokenizer, "lengths")
    assert dataset.num_filtered == 2
    assert [dataset[i]["ground_truth"] for i in range(len(dataset))] == ["5", "10"]
    assert all(len(dataset[i]["prompt_ids"]) <= overhead + 10 for i in range(len(dataset)))
    with pytest.raises(ValueError, match="raise --data.max-prompt-length"):
        PromptDataset(rows_, custom_keys(max_prompt_length=overhead + 1), tokenizer, "lengths")


# ---------------------------------------------------------------- errors a user can act on


def test_missing_key_names_key_dataset_and_columns(tmp_path, tokenizer):
    rows = load_rows(str(write_jsonl(tmp_path / "data.jsonl", ROWS)))
    with pytest.raises(ValueError) as error:
        PromptDataset(rows, DataConfig(), tokenizer, "my-data")  # default prompt_key "problem"
    message = str(error.value)
    for expected in ("'problem'", "'my-data'", "'question'", "'solution'", "'source'", "--data.prompt-key"):
        assert expected in message
    with pytest.raises(ValueError, match="'answer'.*--data.answer-key"):
        PromptDataset(rows, DataConfig(prompt_key="question"), tokenizer, "my-data")


def test_non_string_prompt_names_row_and_key(tmp_path, tokenizer):
    rows = [{"question": "fine", "solution": "1"}, {"question": None, "solution": "2"}]
    with pytest.raises(ValueError, match=r"'bad', row 1: column 'question'"):
        PromptDataset(load_rows(str(write_jsonl(tmp_path / "bad.jsonl", rows))), custom_keys(), tokenizer, "bad")


def test_missing_paths(tmp_path, tokenizer):
    for missing in (tmp_path / "nope.parquet", tmp_path / "no_folder", "data/nope.jsonl"):
        with pytest.raises(FileNotFoundError, match=str(missing)):
            load_rows(str(missing))
    with pytest.raises(FileNotFoundError, match="templates/nope.jinja.*--data.format-prompt.*templates/math.jinja"):
        PromptDataset(load_rows("toy@test"), DataConfig(format_prompt="templates/nope.jinja"), tokenizer, "toy")


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not a parquet file")
    with pytest.raises(ValueError, match="broken.parquet") as error:
        load_rows(str(path))
    assert error.value.__cause__ is not None


def test_unreachable_hub_dataset(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what an offline machine sees, without the retries
    with pytest.raises(ValueError, match="'someone/math12k'.*offline.*local file"):
        load_rows("someone/math12k@test")


# ---------------------------------------------------------------- the loader


def test_two_ranks_cover_each_global_batch_once():
    data = list(range(24))
    ranks = [PromptLoader(data, batch_size=8, rank=r, world_size=2, seed=3, shuffle=True) for r in range(2)]
    seen = []
    for _ in range(3):  # one epoch
        first, second = (loader.next_batch() for loader in ranks)
        assert len(first) == len(second) == 4 and not set(first) & set(second)
        seen += first + second
    assert sorted(seen) == data and seen != data  # every prompt once, shuffled
    assert all(loader.epoch == 0 for loader in ranks)


def test_epochs_reshuffle_and_drop_the_incomplete_batch():
    loader = PromptLoader(list(range(10)), batch_size=4, rank=0, world_size=1, seed=0, shuffle=True)
    epoch0 = loader.next_batch() + loader.next_batch()  # 2 prompts left over: dropped
    epoch1 = loader.next_batch() + loader.next_batch()
    assert loader.epoch == 1 and epoch0 != epoch1
    assert len(set(epoch0)) == len(set(epoch1)) == 8
    ordered = PromptLoader(list(range(10)), batch_size=4, rank=1, world_size=2, seed=0, shuffle=False)
    assert [ordered.next_batch() for _ in range(3)] == [[2, 3], [6, 7], [2, 3]]


def test_same_seed_same_order():
    def batches(seed):
        loader = PromptLoader(list(range(50)), batch_size=10, rank=0, world_size=1, seed=seed, shuffle=True)
        return [loader.next_batch() for _ in range(12)]

    assert batches(1) == batches(1) and batches(1) != batches(2)


def test_resume_gives_the_identical_next_batch(tokenizer):
    dataset = PromptDataset(load_rows("toy@test"), DataConfig(), tokenizer, "toy@test")
    run = PromptLoader(dataset, batch_size=4, rank=1, world_size=2, seed=5, shuffle=True)
    for _ in range(25):  # 12 batches of 4 per epoch of 50 prompts: into epoch 2
        run.next_batch()
    state = run.state_dict()
    assert state == {"epoch": 2, "position": 4}
    resumed = PromptLoader(dataset, batch_size=4, rank=1, world_size=2, seed=5, shuffle=True)
    resumed.load_state_dict(state)
    for _ in range(4):
        assert resumed.next_batch() == run.next_batch()
    # the state counts global prompts: one rank resuming a 2-rank run gets both ranks' shares
    two = [PromptLoader(list(range(30)), batch_size=6, rank=r, world_size=2, seed=0, shuffle=True) for r in range(2)]
    for _ in range(7):
        [loader.next_batch() for loader in two]
    one = PromptLoader(list(range(30)), batch_size=6, rank=0, world_size=1, seed=0, shuffle=True)
    one.load_state_dict(two[0].state_dict())
    assert one.next_batch() == two[0].next_batch() + two[1].next_batch()


def test_loader_errors():
    with pytest.raises(ValueError, match="batch of 6 prompts .* 4 ranks"):
        PromptLoader(list(range(100)), batch_size=6, rank=0, world_size=4, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="has 5 prompts.*batch of 8"):
        PromptLoader(list(range(5)), batch_size=8, rank=0, world_size=1, seed=0, shuffle=True)


def test_shard():
    shards = [shard(list(range(10)), rank, 3) for rank in range(3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
