"""reasoning-gym's generated tasks (https://github.com/open-thought/reasoning-gym), each scored by
its own verifier: `--data.train-files reasoning_gym:NAME --reward.function reasoning_gym`
(`grpo.py reasoning_gym_qwen2_5_3b`). reasoning_gym is imported only when a run asks for a task:
its import takes a second or more."""

import difflib
import functools
import re
from collections.abc import Mapping

from rewards import RewardError, RewardInput

REASONING_GYM = "reasoning_gym:"
# (seed, rows) of each split. Nearly every task draws its row i from Random(seed + i): the test
# split's seeds start far past the train split's last (a test seed of 1 would make the test
# rows train rows 1 to 128)
REASONING_GYM_SPLITS = {"train": (0, 2048), "test": (1_000_000, 128)}


@functools.lru_cache(maxsize=8)
def task(name: str, seed: int, size: int):
    """reasoning-gym's task `name` at its default settings, `size` rows from `seed` (a reasoning_gym
    ProceduralDataset: item i is row i, generated when asked). reasoning_gym is imported here, only
    when a run asks for a task: its import takes a second or more. Kept: the reward scores with the
    same object (entry).
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


def rows(split: str, name: str = "") -> list[dict]:
    """The rows of a reasoning-gym task (`reasoning_gym:NAME[@split]`, e.g.
    reasoning_gym:leg_counting), generated at the task's default settings: train 2,048 rows from
    seed 0, test 128 from seed 1,000,000 (REASONING_GYM_SPLITS). Each row: the question, the answer
    (None for a task with many right answers, which its verifier checks), and where the row comes
    from, from which the reward regenerates the entry its verifier reads (entry).

    Generated on every rank at start-up, so the sizes are those most tasks make in well under a
    second: leg_counting makes its 2,048 in 0.03 s, basic_arithmetic in 0.06, spell_backward in
    0.08, knights_knaves in 1.1, and 85 of reasoning-gym 0.1.25's 105 tasks in under 2 s; those that
    search for their puzzles take minutes (countdown 44 s, zebra_puzzles 160, knight_swap
    15 minutes). Six tasks draw from sets (of letters, of words), whose order Python's string
    hashing sets anew in every process: their rows differ between ranks and launches unless
    PYTHONHASHSEED is set (the README's Data section names them).

    >>> row = rows("test", "leg_counting")[0]; row["answer"], row["reasoning_gym"]
    ('134', {'dataset': 'leg_counting', 'seed': 1000000, 'size': 128, 'index': 0})
    """
    if not name:
        raise ValueError(f"--data.train-files {REASONING_GYM}NAME names a reasoning-gym task, e.g. "
                         f"{REASONING_GYM}leg_counting")
    if split not in REASONING_GYM_SPLITS:
        raise ValueError(f"the reasoning-gym dataset {REASONING_GYM}{name} has the splits 'train' "
                         f"and 'test', not {split!r}")
    seed, size = REASONING_GYM_SPLITS[split]
    generated, made = task(name, seed, size), []
    for index in range(size):
        item = generated[index]
        made.append({"problem": item["question"], "answer": item["answer"],
                     "reasoning_gym": {"dataset": name, "seed": seed, "size": size,
                                       "index": index}})
    return made


@functools.lru_cache(maxsize=1024)
def entry(dataset: str, seed: int, size: int, index: int) -> dict:
    """The entry a reasoning-gym row was made from, {"question", "answer", "metadata"}, generated
    again from the row's `reasoning_gym` column: its metadata (tuples, ints, Fractions, numpy
    values) would not survive a dataset's columns, and a task makes row i again the same in the
    process that made it (reasoning-gym's own trainer scores so; list_functions does not always,
    which the reward finds and refuses). Cached: the n responses to a prompt regenerate its
    entry once."""
    return task(dataset, seed, size)[index]


def reward(inp: RewardInput, format_weight: float = 0.0) -> dict[str, float]:
    """reasoning-gym's reward: the answer in the response's last <answer>...</answer>
    (reasoning_gym.utils's extract_answer, as reasoning-gym's own trainer reads it), scored by the
    row's task with its own verifier (its score_answer) against the entry the row was made from
    (entry, metadata and all): 1 right, 0 wrong, between for the partial credit
    some tasks give. A response without the tags is handed to the verifier as no answer (None), as
    reasoning-gym's trainer does: 0 for nearly every task (countdown, fraction_simplification and
    puzzle24 give 0.01).

    accuracy: that score; tagged: the response has the tags; format: reasoning-gym's format reward,
    one <think>...</think> then one <answer>...</answer> and nothing nested; overall = accuracy +
    format_weight x format (added, as reasoning-gym's runs do, with 0.2).
    leg_counting, answer "500": "<think>add</think><answer>500</answer>" -> accuracy 1, format 1,
    overall 1.0 (1.2 with format_weight 0.2); "<answer>500 legs</answer>" -> accuracy 0.375 (3/8:
    the answer inside a longer one), format 0; "500" -> 0.0, tagged 0.
    """
    from reasoning_gym.utils import extract_answer

    row = inp["row"]
    source = row.get("reasoning_gym")
    if not isinstance(source, Mapping):
        raise RewardError("--reward.function reasoning_gym scores rows of --data.train-files "
                          "reasoning_gym:NAME, and this row has no 'reasoning_gym' column "
                          f"(its columns: {sorted(row)})")
    missing = sorted({"dataset", "seed", "size", "index"} - set(source))
    if missing:
        raise RewardError(f"--reward.function reasoning_gym: the row's 'reasoning_gym' column "
                          f"{dict(source)} lacks {missing}, from which the task's entry is "
                          "generated again")
    made = entry(source["dataset"], source["seed"], source["size"], source["index"])
    if made["question"] != row.get("problem"):
        raise RewardError(f"reasoning-gym task {source['dataset']!r} makes row {source['index']} "
                          f"(seed {source['seed']}, size {source['size']}) again as another "
                          "question than the row's 'problem', so the answer cannot be checked: its "
                          "generator is not deterministic (reasoning-gym 0.1.25's list_functions "
                          "draws from Python's global random; choose another task), or the row was "
                          "made in another process (set PYTHONHASHSEED: README, Data)")
    answer = extract_answer(inp["response"])
    accuracy = float(task(source["dataset"], source["seed"], source["size"])
                     .score_answer(answer, made))
    format_ok = _think_then_answer(inp["response"])
    return {"overall": accuracy + format_weight * format_ok, "accuracy": accuracy,
            "format": format_ok, "tagged": float(answer is not None)}


def _think_then_answer(response: str) -> float:
    """reasoning-gym's format reward: 1.0 for one <think>...</think> then one <answer>...</answer>
    (after optional spaces; anything may follow), neither inside the other; else 0.0."""
    thoughts = re.findall(r"<think>(.*?)</think>", response, re.DOTALL)
    answers = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    nested = any(tag in part for part in thoughts + answers for tag in ("<think>", "<answer>"))
    laid_out = (re.match(r"\s*<think>.*?</think>\s*<answer>.*?</answer>", response, re.DOTALL)
                is not None)
    return float(laid_out and len(thoughts) == len(answers) == 1 and not nested)


def check(format_weight: float = 0.0) -> None:
    """At start-up: reasoning-gym, whose verifiers score the answers, is installed."""
    try:
        # imported here only: its import takes a second or more
        import reasoning_gym.utils  # noqa: F401
    except ImportError:
        raise RewardError("--reward.function reasoning_gym needs reasoning-gym: "
                          "pip install reasoning-gym") from None


reward.check = check
