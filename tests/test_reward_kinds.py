"""Rewards beyond one plain function (rewards.py): async rewards (per sample and batched) running at once within
--reward.max-concurrency, while the caller goes on; every way an async call fails, a loop-blocking one included;
--reward.on-error skip-group; the weighted overall; the LLM judge against a local stub server (its answers, the
cache, retries on a 500, a timeout, a reply without a score or that is no chat completion, a parser that raises, the
start-up probe of its URL and model list); and the reward model's scores against a plain forward of the same
checkpoint. The judge against a real `vllm serve`, and every kind under torchrun, are in
test_reward_runs.py."""

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from features.reward_model import batched_scores, sequence_scores
from fsdp_utils import load_sharded_model
from logprobs import make_batch
from plumbing.tiny import build_tiny_model
from rewards import RewardConfig, RewardError, RewardFunction, combine

ASYNC_REWARDS = '''
import asyncio, sys, time

running = peak = 0

async def per_sample(inp, pause=0.2):
    global running, peak
    running += 1
    peak = max(peak, running)
    await asyncio.sleep(pause)
    running -= 1
    return {"overall": float(len(inp["response"])), "peak": float(peak)}

async def batch(inputs):
    await asyncio.sleep(0.05)
    return [{"overall": float(i)} for i, _ in enumerate(inputs)]

async def misbehaves(inp):
    kind = inp["ground_truth"]
    if kind == "sleeps":
        await asyncio.sleep(3600)
    if kind == "blocks":  # a plain sleep inside an async def: its event loop is stuck
        time.sleep(3600)
    if kind == "raises":
        raise ZeroDivisionError("boom")
    if kind == "exits":
        sys.exit("bye")
    if kind == "bad":
        return {"overall": "1"}
    return {"overall": 1.0}
'''


def sample(response: str, ground_truth="7", prompt="what is 3 + 4?") -> dict:
    return dict(response=response, response_length=len(response), ground_truth=ground_truth, prompt=prompt,
                row={"problem": prompt, "answer": ground_truth}, images=[], videos=[], messages=[])


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "async_rewards.py"
    path.write_text(ASYNC_REWARDS)
    return str(path)


def test_async_rewards_run_at_once_within_the_concurrency_limit_while_the_caller_goes_on(rewards_file):
    """8 calls that each wait 0.2 s, at most 3 at once: submit returns at once, the scores come in the order of the
    samples, no more than 3 ran together, and the whole took 3 rounds (0.6 s), not 8 (1.6 s)."""
    reward = RewardFunction(RewardConfig(f"{rewards_file}:per_sample", max_concurrency=3))
    start = time.monotonic()
    pending = reward.submit([sample("x" * k) for k in range(8)])
    submitted = time.monotonic() - start
    scores = pending.result()
    took = time.monotonic() - start
    assert submitted < 0.1 and 0.55 < took < 1.2, (submitted, took)
    assert [s["overall"] for s in scores] == [float(k) for k in range(8)]
    assert max(s["peak"] for s in scores) == 3.0


def test_an_async_batch_reward_is_one_call(rewards_file):
    reward = RewardFunction(RewardConfig(f"{rewards_file}:batch", batch=True))
    assert reward([sample("a"), sample("b"), sample("c")]) == [{"overall": 0.0}, {"overall": 1.0}, {"overall": 2.0}]


@pytest.mark.parametrize("kind, problem", [("sleeps", "ran past --reward.timeout 0.3s"),
                                           ("raises", "raised ZeroDivisionError('boom')"),
                                           ("exits", "called sys.exit('bye')"),
                                           ("bad", "returned overall='1', expected a finite number")])
def test_a_failing_async_call_is_a_reward_error_naming_the_sample(rewards_file, kind, problem):
    reward = RewardFunction(RewardConfig(f"{rewards_file}:misbehaves", timeout=0.3))
    with pytest.raises(RewardError, match=rf"{re.escape(problem)} on sample 1 .*ground_truth='{kind}'"):
        reward([sample("a"), sample("b", kind)])
    assert reward([sample("a")]) == [{"overall": 1.0}]  # the loop is still there for the next call


def test_an_async_call_that_blocks_its_loop_is_given_up_and_the_run_goes_on(rewards_file):
    """A blocking sleep in an async def never yields, so the call's own time limit cannot fire: the caller stops
    waiting once every call has had its limit, scores the stuck ones 0 (on-error zero), and returns."""
    reports = []
    reward = RewardFunction(RewardConfig(f"{rewards_file}:misbehaves", timeout=0.5, on_error="zero"),
                            report=reports.append)
    start = time.monotonic()
    scores = reward([sample("a", "blocks"), sample("b")])
    assert time.monotonic() - start < 3
    assert [s["failed"] for s in scores] == [1.0, 1.0]  # the second waited behind the stuck loop
    assert len(reports) == 1 and "ran past --reward.timeout 0.5s on sample 0" in reports[0]


def test_skip_group_scores_a_failure_0_and_marks_it(rewards_file):
    """--reward.on-error skip-group: the loop leaves out every group holding a sample marked failed
    (rollout.RolloutProducer; under torchrun in test_reward_runs.py)."""
    reports = []
    reward = RewardFunction(RewardConfig(f"{rewards_file}:misbehaves", on_error="skip-group"), report=reports.append)
    assert reward([sample("a"), sample("b", "raises")]) == [{"overall": 1.0, "failed": 0.0},
                                                            {"overall": 0.0, "failed": 1.0}]
    assert "its group left out of the step (--reward.on-error skip-group)" in reports[0]


def test_the_weighted_overall_by_hand():
    scores = [{"overall": 1.0, "accuracy": 1.0, "model": 0.4}, {"overall": 0.5, "accuracy": 0.0, "model": -2.0}]
    assert combine(scores, {"overall": 1.0, "model": 0.5}) == [
        {"overall": 1.2, "accuracy": 1.0, "model": 0.4, "function": 1.0},  # 1 + 0.5 x 0.4
        {"overall": -0.5, "accuracy": 0.0, "model": -2.0, "function": 0.5}]  # 0.5 + 0.5 x -2
    assert combine(scores, {}) is scores
    with pytest.raises(RewardError, match="--reward.weights names \\['format'\\]"):
        combine(scores, {"format": 1.0})
    # without a reward model the reward function applies them itself: accuracy 1 x 2 + overall 0.5 x 1 for "7"
    weighted = RewardFunction(RewardConfig("toy", weights={"accuracy": 2.0, "overall": 1.0}))([sample("77")])
    assert weighted == [{"overall": 2.5, "accuracy": 1.0, "concise": 0.0, "function": 0.5}]


# ---------------------------------------------------------------- the judge, against a stub of an OpenAI endpoint


class Stub(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint whose chat answer depends on the prompt: a score, a 500, a pause, no number, a
    body that is no completion (GARBAGE); under /no-models it lists no model."""

    requests: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):  # /v1/models
        models = [] if self.path.startswith("/no-models/") else [{"id": "stub-judge", "object": "model"}]
        self._send(200, {"object": "list", "data": models})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        Stub.requests.append(prompt)
        if "server error" in prompt:
            return self._send(500, {"error": "boom"})
        if "slow" in prompt:  # past the client's timeout: it has gone when this would answer
            time.sleep(2)
            return
        if prompt.split(" | ")[0] in GARBAGE:  # the template's first part: the sample's prompt
            return self._send(200, GARBAGE[prompt.split(" | ")[0]])
        text = "no score here" if "garbled" in prompt else f"Score: {len(prompt) % 2}. Final: {body['max_tokens']}"
        self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}]})

    def _send(self, status: int, payload: dict | list | str):
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


GARBAGE = {"html": "<html><body>Sign in</body></html>", "a list": [], "nothing": {},
           "no choices": {"id": "x", "object": "chat.completion", "created": 0, "model": "stub-judge", "choices": []}}


@pytest.fixture(scope="module")
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def judge(url: str, tmp_path, **config) -> RewardFunction:
    template = tmp_path / "judge.jinja"
    template.write_text("{{ prompt }} | {{ response }} | {{ ground_truth }}")
    return RewardFunction(RewardConfig("judge", judge_url=url, judge_template=str(template), judge_retries=1,
                                       judge_timeout=0.5, judge_request='{"max_tokens": 5}', **config))


def test_the_judge_scores_each_response_once_and_asks_nothing_twice(stub_url, tmp_path):
    """The last number of the reply is the score (the stub's reply ends with the request's max_tokens, set by
    --reward.judge-request); the same prompt, response and ground truth are asked once."""
    Stub.requests.clear()
    reward = judge(stub_url, tmp_path)
    scores = reward([sample("a"), sample("b"), sample("a")])
    assert scores == [{"overall": 5.0}] * 3
    assert sorted(Stub.requests) == ["what is 3 + 4? | a | 7", "what is 3 + 4? | b | 7"]
    assert reward.fn.client.asked == 2 and reward.fn.client.cached == 1 and reward.fn.client.model == "stub-judge"
    parsed = judge(stub_url, tmp_path, judge_parser=r"Score: (\d)")([sample("c")])  # a group: the score itself
    assert parsed == [{"overall": float(len("what is 3 + 4? | c | 7") % 2)}]


def first_sample_fails(stub_url, tmp_path, prompt: str) -> list[str]:
    """Two samples judged under --reward.on-error zero, the first asking `prompt` (which fails it), the stub's
    requests counted from here: the first scores 0 as failed, the second its 5; what the reward reported."""
    Stub.requests.clear()
    reports = []
    reward = judge(stub_url, tmp_path, on_error="zero")
    reward.report = reports.append
    scores = reward([sample("a", prompt=prompt), sample("b")])
    assert scores[0]["failed"] == 1.0 and scores[1] == {"overall": 5.0, "failed": 0.0}
    return reports


@pytest.mark.parametrize("prompt, problem", [("server error", "raised InternalServerError"),
                                             ("slow", "raised APITimeoutError"),
                                             ("garbled", "holds no score")])
def test_the_judge_retries_then_fails_the_sample_as_on_error_says(stub_url, tmp_path, prompt, problem):
    """A 500 and a timeout are retried (--reward.judge-retries 1: two requests) before the sample fails; a reply
    without a score fails at once. On-error zero scores it 0 and the others go on."""
    reports = first_sample_fails(stub_url, tmp_path, prompt)
    assert problem in reports[0]
    assert Stub.requests.count(f"{prompt} | a | 7") == (1 if prompt == "garbled" else 2)
    with pytest.raises(RewardError, match=re.escape(problem)):
        judge(stub_url, tmp_path)([sample("a", prompt=prompt)])


@pytest.mark.parametrize("prompt", GARBAGE)
def test_a_reply_that_is_no_chat_completion_fails_the_sample_naming_the_endpoint(stub_url, tmp_path, prompt):
    """An HTML page, a JSON list, `{}`, a completion without choices: the sample's failure (one request, not
    retried), its line naming --reward.judge-url (and the model, for no choices) and showing the reply's start."""
    reports = first_sample_fails(stub_url, tmp_path, prompt)
    reply = GARBAGE[prompt] if isinstance(GARBAGE[prompt], str) else json.dumps(GARBAGE[prompt])
    expected = ("holds no choices (check that --reward.judge-model 'stub-judge' answers chat completions at "
                f"--reward.judge-url {stub_url}" if prompt == "no choices" else
                f"is no OpenAI chat completion (is --reward.judge-url {stub_url} an OpenAI-compatible endpoint")
    assert f"reward 'judge' failed: the judge's reply {reply!r:.40}" in reports[0] and expected in reports[0]
    assert Stub.requests.count(f"{prompt} | a | 7") == 1
    with pytest.raises(RewardError, match=re.escape(expected)):
        judge(stub_url, tmp_path)([sample("a", prompt=prompt)])


def test_a_parser_function_that_raises_fails_the_sample_naming_the_parser_and_the_reply(stub_url, tmp_path):
    """--reward.judge-parser path/to/file.py:function raising on a reply: a bug of the user's parser, said so."""
    parser = tmp_path / "parsers.py"
    parser.write_text("def score(text):\n    raise ValueError('parser bug')\n")
    with pytest.raises(RewardError, match=re.escape(f"reward 'judge' failed: --reward.judge-parser '{parser}:score' "
                                                    "raised ValueError('parser bug') (the judge's reply: 'Score: ")):
        judge(stub_url, tmp_path, judge_parser=f"{parser}:score")([sample("a")])


def test_the_judge_is_refused_without_an_endpoint_or_with_a_bad_request():
    with pytest.raises(RewardError, match="needs --reward.judge-url"):
        RewardFunction(RewardConfig("judge"))
    with pytest.raises(RewardError, match="--reward.judge-request .* is not JSON"):
        RewardFunction(RewardConfig("judge", judge_url="http://127.0.0.1:1/v1", judge_request="{max_tokens: 5"))


def test_the_judges_url_and_model_are_found_when_the_reward_is_built(stub_url, tmp_path):
    """One request at start-up (the model list) finds a URL where nothing listens or nothing answers in
    --reward.judge-timeout, and an endpoint that lists no model while --reward.judge-model is empty: each one line
    naming the flag, before any rollout. A named model needs no list."""
    with pytest.raises(RewardError, match=r"^--reward.judge-url http://127.0.0.1:9/v1: .*Connection refused; serve "):
        judge("http://127.0.0.1:9/v1", tmp_path)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    with pytest.raises(RewardError, match=f"^--reward.judge-url {url}: no answer within --reward.judge-timeout 0.5s"):
        judge(url, tmp_path)
    silent.close()
    empty = stub_url.replace("/v1", "/no-models/v1")
    listing = json.dumps({"object": "list", "data": []})
    with pytest.raises(RewardError, match=re.escape(f"--reward.judge-url {empty} lists no model (HTTP 200: "
                                                    f"{listing!r}); name the judge's model with --reward.judge-model")):
        judge(empty, tmp_path)
    assert judge(empty, tmp_path, judge_model="named").fn.client.model == "named"


# ---------------------------------------------------------------- the reward model


def test_the_reward_models_scores_are_a_plain_forwards(tmp_path, world_of_one):
    """The tiny reward model sharded as the trainer loads it (FSDP2), packed and padded, against transformers'
    AutoModelForSequenceClassification on each sequence alone: its pooled score."""
    path = build_tiny_model("qwen2_rm", tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(path)
    sharded = load_sharded_model(str(path), torch.device("cpu"), trainable=False)
    prompts, responses = [[1, 40, 41], [1, 50], [1, 60, 61, 62, 63]], [[70, 2], [71, 72, 73, 2], [74]]
    batch = make_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        expected = torch.stack([plain(input_ids=torch.tensor([p + r])).logits[0, 0]
                                for p, r in zip(prompts, responses)])
        for padding_free in (True, False):
            torch.testing.assert_close(sequence_scores(sharded, batch, padding_free), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched_scores(sharded, batch, micro_batch_size=2), expected, atol=1e-5, rtol=0)
    assert not torch.equal(expected[0], expected[1])


def test_the_reward_models_score_head_runs_in_fp32(tmp_path, world_of_one):
    """A bf16 reward model (as on GPU): its score is the fp32 product of the last token's bf16 hidden state and the
    bf16 head weights, not that product rounded to bf16 (3 significant digits of a number the advantages compare)."""
    from logprobs import decoder_states, forward_inputs

    path = build_tiny_model("qwen2_rm", tmp_path / "rm")
    model = load_sharded_model(str(path), torch.device("cpu"), trainable=False, dtype=torch.bfloat16)
    batch = make_batch([[1, 40, 41], [1, 50]], [[70, 2], [71, 72, 73, 2]], pad_id=0)
    with torch.no_grad():
        scores = sequence_scores(model, batch)
        states = decoder_states(model, forward_inputs(model, batch, True)[0]).flatten(0, 1)
        last = states[torch.tensor([4, 10])]  # the sequences' last tokens in the packed row of 5 and 6
        weight = model.score.weight  # unsharded: FSDP2 keeps the root gathered after its forward
        expected = last.float() @ weight.float().T
    assert scores.dtype == torch.float32 and torch.equal(scores, expected[:, 0])
    assert not torch.equal(scores, scores.bfloat16().float())


def test_a_reward_model_is_refused_unless_it_is_one_and_shares_the_policys_tokenizer(tmp_path, world_of_one):
    from transformers import AutoTokenizer

    from features.reward_model import load_reward_model

    policy = build_tiny_model("qwen2", tmp_path / "policy")
    tokenizer = AutoTokenizer.from_pretrained(policy)
    with pytest.raises(SystemExit, match="not a reward model .* but Qwen2ForCausalLM"):
        load_reward_model(str(policy), torch.device("cpu"), tokenizer)
    other = AutoTokenizer.from_pretrained(build_tiny_model("qwen2_5_bpe", tmp_path / "bpe"))
    with pytest.raises(SystemExit, match="its tokenizer is not the policy's"):
        load_reward_model(str(build_tiny_model("qwen2_rm", tmp_path / "rm")), torch.device("cpu"), other)
    assert load_reward_model(str(tmp_path / "rm"), torch.device("cpu"), tokenizer).config.num_labels == 1
