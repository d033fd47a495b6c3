"""Run under torchrun by test_episodes.py: multi-turn episodes (episodes.EpisodeRollout) on a real engine, first of tool
calls (tools.py's environment), then against a respond-style environment class (env.py), and the trainer's log-probs of
the same episodes.

argv: CASES OUT PORTS, as tests/rollout_worker.py's (a case ENGINE:ARCHITECTURE, ARCHITECTURE qwen2_5_bpe or
qwen2_5_vl). A random model never writes a real `<tool_call>`, so the parser (a file written here, passed as
`path.py:function` as a user would) calls the one tool, `probe`, on every turn. Rank 0's tool answers (with a crop of
the prompt's picture for the vision-language model), so its episodes run to --rollout.max-turns 3; rank 1's raises,
and --rollout.max-env-errors 1 ends its episodes after turn 1: rank 0 then generates turns 2 and 3 alone, which hangs
unless rank 1 joins them (the hf engine gathers the FSDP2 weights in every generate call). The environment (a file
too, `--rollout.env path.py:Game`) keeps state across turns, counts them in its answers, shows a picture to the
vision-language model, and never says done on rank 0 (3 turns); on rank 1 it raises or hangs past
--rollout.env-timeout at its first answer. The engine is wrapped in a recorder of every call, to check token in, token
out: each later turn's prompt is the episode's prompt plus its response so far, exactly, and the response is its turns'
sampled ids and the rendered answers, nothing re-tokenized. The trainer's batch (logprobs.batch_of) then gives
log-probs, packed and padded, to compare with the engine's on the generated tokens.
"""

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from fsdp_utils import init_distributed, load_sharded_model
from logprobs import batch_of, batched_logprobs
from plumbing.tiny import build_tiny_model
from rewards import Group
from plumbing.engine_env import vllm_environment
from rollout import RolloutConfig, build_rollout
from rollout_worker import TEMPERATURE, cases, every_rank
from data import OPEN_TURN
from features.env import RespondEnvironment, environment_class
from features.episodes import EpisodeRollout
from features.tools import ToolConfig, ToolEnvironment, load_parser, load_tools, tool_schema
from model.vision import image_tokens

TOOLS = '''
def probe(row: dict, images: list) -> str | list:
    """Read this question's hidden value (and, when the question has a picture, its top-left corner)."""
    if row["fail"]:
        raise RuntimeError(f"no value for question {row['id']}")
    value = f"value {row['value']}"
    return [images[0].crop((0, 0, 56, 56)), value] if images else value
'''
PARSER = '''
from features.tools import ToolCall


def every_turn(text):
    """Whatever the turn says, it calls `probe`."""
    return [ToolCall("probe", {})]
'''
GAME = '''
import threading

from PIL import Image


class Game:
    """Keeps count of the turns and says so; a picture with every answer where the row asks for one. Never says done,
    unless told to fail: then its first answer raises, or hangs."""

    def reset(self, value: int, fail: str, picture: bool) -> str:
        self.value, self.fail, self.picture, self.turns = value, fail, picture, 0
        return f" The value is {value}."

    def respond(self, turn: str):
        self.turns += 1
        if self.fail == "raises":
            raise RuntimeError("the board is gone")
        if self.fail == "hangs":
            threading.Event().wait()
        answer = f"turn {self.turns} of {self.value}"
        return [Image.new("RGB", (56, 56), (self.turns * 60, 0, 0)), answer] if self.picture else answer
'''
MAX_TURNS, TURN_TOKENS = 3, 6
BUDGET = {"qwen2_5_bpe": 96, "qwen2_5_vl": 128}  # room for 3 turns and 2 tool turns (a crop is 4 image tokens)
# a tool turn and an environment's answer as each tiny model's chat template renders them (plumbing/tiny.py), after the
# turn they answer
TOOL_TURN = {"qwen2_5_bpe": "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n",
             "qwen2_5_vl": "\n<|im_start|>tool\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
                           "<|im_start|>assistant\n"}
ANSWER = {"qwen2_5_bpe": "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
          "qwen2_5_vl": "\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
                        "<|im_start|>assistant\n"}
ENDING = " The value is {}.<|im_end|>\n<|im_start|>assistant\n"  # the first answer ends the prompt's user turn


class Recorder:
    """The engine, with a record of every generate call: its prompts (ids, images) and what it sampled."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts, version, validation=False, greedy=False, n=None, max_tokens=None):
        groups = self.engine.generate(prompts, version, validation, greedy, n=n, max_tokens=max_tokens)
        self.calls.append({"prompt_ids": [list(p["prompt_ids"]) for p in prompts],
                           "images": [list(p.get("images") or []) for p in prompts], "n": n, "max_tokens": max_tokens,
                           "outputs": [[list(r.token_ids) for r in group] for group in groups]})
        return groups


def runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """(start, end) of each run of `value` in `mask`: [1, 1, 0, 0, 1] -> value 1: [(0, 2), (4, 5)]."""
    spans, start = [], None
    for t, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = t
        elif m != value and start is not None:
            spans.append((start, t))
            start = None
    return spans


def token_in_token_out(calls: list[dict], prompts: list[dict], groups: list, tokenizer,
                       given_text: Callable) -> dict[str, bool]:
    """Each generated run of a response is one engine call's sample: turn 1 the first call's (n per prompt, its prompt
    the episode's prompt and what is given before the turn), every later turn a call (n=1) whose prompt is exactly the
    episode's prompt and its response up to that turn, with the prompt's images and the given ones so far; every
    later call's prompt is such a turn (a bijection); the k-th given run decodes to given_text(item, response, k,
    ended), `ended` telling whether the turn before it ended with the template's end token (or was cut short, or
    ended by <|endoftext|>)."""
    first, later = calls[0], [(ids, images, outputs[0]) for call in calls[1:]
                              for ids, images, outputs in zip(call["prompt_ids"], call["images"], call["outputs"])]
    checks = {"first_call": first["n"] is None and len(first["prompt_ids"]) == len(prompts),
              "later_calls_one_sample": all(call["n"] == 1 and all(len(o) == 1 for o in call["outputs"])
                                            for call in calls[1:]),
              "turns_are_samples": True, "given_rendered": True, "aligned": True}
    for j, (item, group) in enumerate(zip(prompts, groups)):
        for i, r in enumerate(group):
            generated, given = runs(r.mask, 1), runs(r.mask, 0)
            holes = [t for start, end in given for t in range(start, end)]
            checks["aligned"] &= len(r.token_ids) == len(r.logprobs) == len(r.mask) and \
                len(generated) == r.episode.turns and all(r.logprobs[t] == 0.0 for t in holes)
            before = generated[0][0]
            checks["first_call"] &= first["prompt_ids"][j] == item["prompt_ids"] + r.token_ids[:before]
            checks["turns_are_samples"] &= generated[0] == (before, before + len(first["outputs"][j][i])) and \
                r.token_ids[before: generated[0][1]] == first["outputs"][j][i]
            for start, end in generated[1:]:
                images = item["images"] + r.images[: r.token_ids[:start].count(tokenizer.convert_tokens_to_ids(
                    "<|image_pad|>"))]
                match = next((k for k, (ids, seen, output) in enumerate(later)
                              if ids == item["prompt_ids"] + r.token_ids[:start] and output == r.token_ids[start:end]
                              and len(seen) == len(images) and all(a is b for a, b in zip(seen, images))), None)
                checks["turns_are_samples"] &= match is not None
                if match is not None:
                    later.pop(match)
            for k, (start, end) in enumerate(given):
                ended = start > 0 and r.token_ids[start - 1] == tokenizer.eos_token_id
                checks["given_rendered"] &= tokenizer.decode(r.token_ids[start:end]) == given_text(item, r, k, ended)
    checks["every_call_a_turn"] = not later
    return checks


def tool_turn(architecture: str, tokenizer) -> Callable:
    """The tool episodes' given_text: the k-th tool turn shows the k-th tool message's text."""
    def given_text(item: dict, response, k: int, ended: bool) -> str:
        result = [m for m in response.episode.messages if m["role"] == "tool"][k]["content"]
        text = result if isinstance(result, str) else next(p["text"] for p in result if p["type"] == "text")
        return ("" if ended else tokenizer.eos_token) + TOOL_TURN[architecture].format(text)
    return given_text


def game_answer(architecture: str, tokenizer) -> Callable:
    """The game's given_text: first the end of the user's turn (reset's answer), then its count of the turns."""
    def given_text(item: dict, response, k: int, ended: bool) -> str:
        value = item["row"]["value"]
        if k == 0:
            return ENDING.format(value)
        return ("" if ended else tokenizer.eos_token) + ANSWER[architecture].format(f"turn {k} of {value}")
    return given_text


def trainer_side(actor, prompts: list[dict], groups: list, processor, tokenizer, device) -> dict:
    """The trainer's batch of the episodes (images expanded, holes in the mask): its log-probs, packed and padded,
    against the engine's on the generated tokens, and what is masked."""
    batch = batch_of([Group(item, group, [{"overall": 0.0}] * len(group)) for item, group in zip(prompts, groups)],
                     processor, tokenizer.pad_token_id, device)
    packed = batched_logprobs(actor, batch, TEMPERATURE, micro_batch_size=8, padding_free=True)  # [B, R]
    padded = batched_logprobs(actor, batch, TEMPERATURE, micro_batch_size=8, padding_free=False)  # [B, R]
    generated = batch.response_mask.bool()  # [B, R]
    valid = torch.arange(batch.responses.shape[1]) < torch.tensor(batch.response_lengths)[:, None]  # [B, R]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    image_slots = (batch.responses == image_pad) & valid
    responses = [r for group in groups for r in group]
    return {
        "turns": [r.episode.turns for r in responses], "stop_reasons": [r.episode.stop_reason for r in responses],
        "calls": [r.episode.calls for r in responses], "errors": [r.episode.errors for r in responses],
        "lengths": [len(r.token_ids) + sum(image_tokens(processor, i.size) - 1 for i in r.images) for r in responses],
        "gap": (packed - batch.rollout_logprobs)[generated].abs().max().item(),
        "packed_vs_padded": (packed - padded)[generated].abs().max().item(),
        "generated_tokens": int(generated.sum()), "masked_tokens": int((valid & ~generated).sum()),
        "masked_share": (valid & ~generated).sum().item() / valid.sum().item(),
        "given_images": sum(len(r.images) for r in responses),
        "given_image_tokens": sum(image_tokens(processor, i.size) for r in responses for i in r.images),
        "image_slots_in_responses": int(image_slots.sum()),
        "image_slots_masked": not (image_slots & generated).any().item(),
        "rows_with_vision": sum(v is not None for v in batch.vision or []),
    }


def episodes(engine: str, architecture: str, out: str) -> list[dict] | None:
    rank, world, device = init_distributed()
    path = f"{out}.{engine}-{architecture}"
    tools_file, parser_file, game_file = f"{path}.tools.py", f"{path}.parser.py", f"{path}.game.py"
    if rank == 0:
        build_tiny_model(architecture, path)
        Path(tools_file).write_text(TOOLS)
        Path(parser_file).write_text(PARSER)
        Path(game_file).write_text(GAME)
    dist.barrier()
    vision = architecture.endswith("_vl")
    processor = AutoProcessor.from_pretrained(path) if vision else None
    tokenizer = processor.tokenizer if vision else AutoTokenizer.from_pretrained(path)
    actor = load_sharded_model(path, device, trainable=True)
    cfg = RolloutConfig(engine=engine, n=4, temperature=TEMPERATURE, max_response_length=BUDGET[architecture],
                        max_turns=MAX_TURNS, max_turn_tokens=TURN_TOKENS, max_env_errors=1)
    tool_cfg = ToolConfig(functions=tools_file, parser=f"{parser_file}:every_turn")
    recorder = Recorder(build_rollout(cfg, path, max_model_len=512, device=device, model=actor))
    tools, parse = load_tools(tool_cfg.functions), load_parser(tool_cfg.parser)
    schemas = [tool_schema(fn) for fn in tools.values()]
    rollout = EpisodeRollout(recorder, cfg, lambda: ToolEnvironment(None, tools, parse, tool_cfg, cfg.env_timeout,
                                                                    8 * cfg.max_response_length, processor),
                             tokenizer, processor, device, schemas=schemas)

    # dataset items as data.PromptDataset makes them: the chat template lists the tools; one picture each (VLM)
    prompts = []
    for i, question in enumerate(["What is the hidden value?", "Which value is hidden here?", "Look it up."]):
        images = []
        if vision:
            picture = Image.new("RGB", (112, 84), (40 * i, 200, 90 * rank))
            picture.paste((255, 255 - 60 * i, 0), (0, 0, 56, 42))
            images = [picture]
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        prompt = (processor or tokenizer).apply_chat_template(
            [{"role": "user", "content": content if vision else question}], tools=schemas,
            add_generation_prompt=True, tokenize=False)
        prompts.append({"prompt": prompt, "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"],
                        "images": images, "videos": [], "row": {"id": i, "value": 10 * rank + i, "fail": rank == 1},
                        "ground_truth": str(i)})
    groups = rollout.generate(prompts, version=0)
    tools_result = {"engine_calls": len(recorder.calls),
                    "checks": token_in_token_out(recorder.calls, prompts, groups, tokenizer,
                                                 tool_turn(architecture, tokenizer)),
                    **trainer_side(actor, prompts, groups, processor, tokenizer, device)}

    # the game, a respond-style environment class in a file of its own; its prompts end with the user's text
    recorder.calls = []
    game = environment_class(f"{game_file}:Game")
    cfg.env_timeout = 0.5
    rollout = EpisodeRollout(recorder, cfg, lambda: RespondEnvironment(game, cfg.env_timeout,
                                                                       8 * cfg.max_response_length, processor),
                             tokenizer, processor, device, opens_prompt=True)
    played = []
    for i, prompt in enumerate(prompts):
        content = [{"type": "image"}] * len(prompt["images"]) + [{"type": "text", "text": f"Game {i}.{OPEN_TURN}"}]
        text = (processor or tokenizer).apply_chat_template([{"role": "user", "content": content if vision else
                                                              f"Game {i}.{OPEN_TURN}"}], add_generation_prompt=True,
                                                            tokenize=False)
        text = text[:text.index(OPEN_TURN)]
        fail = "" if rank == 0 else ("raises", "hangs")[i % 2]
        played.append({**prompt, "prompt": text, "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"],
                       "row": {"value": 10 * rank + i, "fail": fail, "picture": vision}})
    groups = rollout.generate(played, version=0)
    game_result = {"engine_calls": len(recorder.calls),
                   "checks": token_in_token_out(recorder.calls, played, groups, tokenizer,
                                                game_answer(architecture, tokenizer)),
                   "saw_every_turn": all(r.episode.environment.turns == r.episode.turns for g in groups for r in g),
                   **trainer_side(actor, played, groups, processor, tokenizer, device)}
    results = every_rank({"rank": rank, "tools": tools_result, "game": game_result})
    rollout.shutdown()
    return results


if __name__ == "__main__":
    vllm_environment()
    cases(episodes, *sys.argv[1:])
    os._exit(0)  # as rollout_worker.py: skip the interpreter's teardown (a rare abort of the CPU stack)
