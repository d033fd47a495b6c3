"""The `judge` reward (Judge, which rewards.py's RewardFunction makes for --reward.function judge) and its client: a
model served at an OpenAI-compatible endpoint (`vllm serve`, an API), asked one prompt at a time, each prompt once
(Judge renders the prompt and reads the score).

- At start-up one request (`model`) lists the endpoint's models, within the time limit and not retried: a URL that
  refuses, names no host or does not answer ends the run there, not at the first rollout.
- Requests are retried with backoff on connection errors, timeouts, 429 and 5xx (openai's client, `retries`).
- The same prompt is asked once, even by calls at the same time: each prompt's answer (what `read` makes of the reply)
  is kept, the last CACHE of them; a failed request or reading is not, and is asked again next time.
- A reply that is no chat completion (HTML, a JSON list, `{}`, no choices) is the call's failure, naming the endpoint
  and showing the reply's start (openai's client fails on it with an AttributeError that names nothing).
"""

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from plumbing.loading import load_function, load_template


class JudgeError(Exception):
    """A failure of the judge's endpoint or reply, in words that say what to check."""


class JudgeClient:
    """Asks the judge at `url` (model `model`, or the first the endpoint lists) for its reply to a prompt; `read` turns
    the reply's text into the answer kept (a score). `request`: JSON fields added to each request; `timeout`: seconds a
    request may take (the start-up one's too)."""

    CACHE = 100_000

    def __init__(self, url: str, model: str, timeout: float, retries: int, request: dict, read: Callable[[str], Any]):
        self.url, self.timeout, self.retries, self.request, self.read = url, timeout, retries, request, read
        self.answers: OrderedDict[str, asyncio.Future] = OrderedDict()  # prompt -> its answer, or the request
        self.client, self.asked, self.cached = None, 0, 0
        self.model = self.find_model(model)

    async def __call__(self, prompt: str) -> Any:
        """The answer to `prompt`, asked once, however many calls want it."""
        if prompt in self.answers:
            self.cached += 1
            self.answers.move_to_end(prompt)
        else:
            self.answers[prompt] = asyncio.ensure_future(self.ask(prompt))
            if len(self.answers) > self.CACHE:
                self.answers.popitem(last=False)
        answer = self.answers[prompt]
        try:  # shielded: a caller's time limit does not cancel the request the other callers wait for
            return await asyncio.shield(answer)
        except BaseException:
            if answer.done() and self.answers.get(prompt) is answer:  # a failure is asked again next time
                del self.answers[prompt]
            raise

    def find_model(self, model: str) -> str:
        """`model`, else the first the endpoint lists, after one request that finds the endpoint: the model list, not
        retried. An endpoint that answers without a list is enough when the model is named."""
        listing = self.list_models()
        if model:
            return model
        names = model_names(listing.text)
        if not names:
            raise JudgeError(f"--reward.judge-url {self.url} lists no model (HTTP {listing.status_code}: "
                             f"{listing.text!r:.80}); name the judge's model with --reward.judge-model")
        return names[0]

    def list_models(self):
        """The endpoint's reply to the model list (an HTTP error's too); a URL where nothing answers is refused."""
        from openai import APIConnectionError, APIStatusError, APITimeoutError, OpenAI

        with OpenAI(base_url=self.url, api_key="EMPTY", max_retries=0, timeout=self.timeout) as client:
            try:
                return client.models.with_raw_response.list()
            except APIConnectionError as error:  # refused, no such host, or no answer in time
                cause = (f"no answer within --reward.judge-timeout {self.timeout:g}s"
                         if isinstance(error, APITimeoutError) else error.__cause__ or error.message)
                raise JudgeError(f"--reward.judge-url {self.url}: {cause}; serve the judge there (`vllm serve MODEL "
                                 "--port 8000`: http://127.0.0.1:8000/v1) or fix the URL") from None
            except APIStatusError as error:
                return error.response

    async def ask(self, prompt: str) -> Any:
        if self.client is None:  # made on the caller's event loop, where it is used
            from openai import AsyncOpenAI

            self.client = AsyncOpenAI(base_url=self.url, api_key="EMPTY", max_retries=self.retries,
                                      timeout=self.timeout)
        self.asked += 1
        reply = await self.client.chat.completions.with_raw_response.create(  # the request's fields go in the body
            model=self.model, messages=[{"role": "user", "content": prompt}], temperature=0.0, max_tokens=64,
            extra_body=self.request)
        return self.read(self.content(reply.text))

    def content(self, body: str) -> str:
        """The text of a chat completion's first choice, read from the reply's body; anything else is the call's
        failure, naming the endpoint and showing the body's start."""
        try:
            reply = json.loads(body)
        except ValueError:
            reply = None
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if choices == []:
            raise JudgeError(f"the judge's reply {body!r:.80} holds no choices (check that --reward.judge-model "
                             f"{self.model!r} answers chat completions at --reward.judge-url {self.url}, and what "
                             "--reward.judge-request asks)")
        message = choices[0].get("message") if isinstance(choices, list) and isinstance(choices[0], dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("content") or "", str):
            raise JudgeError(f"the judge's reply {body!r:.80} is no OpenAI chat completion (is --reward.judge-url "
                             f"{self.url} an OpenAI-compatible endpoint, as vllm serve's /v1?)")
        return message.get("content") or ""


def model_names(body: str) -> list[str]:
    """The names in an OpenAI model list, '{"data": [{"id": "Qwen/Qwen2.5-7B-Instruct", ...}]}'; none in anything
    else."""
    try:
        listing = json.loads(body)
    except ValueError:
        return []
    models = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(models, list):
        return []
    return [m["id"] for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]


# ---------------------------------------------------------------------------------------------------- the reward


class Judge:
    """The `judge` reward (--reward.function judge): a model served at an OpenAI-compatible endpoint (`vllm serve`, an
    API) grades each response (JudgeClient asks it: once a prompt, retried, the endpoint found at start-up). Its prompt
    is --reward.judge-template rendered with the prompt, the response, the ground truth and the row; its score the last
    match of --reward.judge-parser in the reply (or what a parser function returns). The requests go out at once (at
    most --reward.max-concurrency). A reply that is no chat completion or holds no score, and a parser function that
    raises, are the sample's failure (--reward.on-error), named with the start of the reply. `config`:
    rewards.RewardConfig (its judge_* fields); `error`: the class every failure is raised as (rewards.RewardError).
    """

    def __init__(self, config, error: type[Exception]):
        self.error = error
        if not config.judge_url:
            raise error("--reward.function judge needs --reward.judge-url, the OpenAI-compatible endpoint of the "
                        "judge model (e.g. http://127.0.0.1:8000/v1 for `vllm serve MODEL --port 8000`)")
        self.template = load_template(config.judge_template, "--reward.judge-template")
        parse = (parser_function(config.judge_parser, error)
                 if config.judge_parser.endswith(".py") or ".py:" in config.judge_parser
                 else last_number(config.judge_parser, error))
        try:
            request = json.loads(config.judge_request) if config.judge_request else {}
        except json.JSONDecodeError as problem:
            raise error(f"--reward.judge-request {config.judge_request!r} is not JSON: "
                        f"{problem}") from None
        try:
            self.client = JudgeClient(config.judge_url, config.judge_model, config.judge_timeout,
                                      config.judge_retries, request, parse)
        except JudgeError as problem:
            raise error(str(problem)) from None

    async def __call__(self, inp: dict) -> dict[str, float]:
        prompt = self.template.render(prompt=inp["prompt"], response=inp["response"],
                                      ground_truth=inp["ground_truth"], row=inp["row"])
        try:
            return await self.client(prompt)
        except JudgeError as error:
            raise self.error(str(error)) from None


def last_number(pattern: str, error: type[Exception]) -> Callable[[str], dict[str, float]]:
    """A parser: the last match of `pattern` in the reply is the score; no match raises, naming the
    reply."""
    regex = re.compile(pattern)

    def parse(text: str) -> dict[str, float]:
        matches = regex.findall(text)
        if not matches:
            raise error(f"the judge's reply {text!r:.80} holds no score (--reward.judge-parser {pattern!r})")
        return {"overall": float(matches[-1] if isinstance(matches[-1], str) else matches[-1][0])}

    return parse


def parser_function(spec: str, error: type[Exception]) -> Callable[[str], dict[str, float]]:
    """A parser: path/to/file.py:function, reply text -> a float, or a dict of scores with overall.
    A failure (what it raises, a result that is no number) names the parser and the reply it failed
    on."""
    try:
        fn = load_function(spec, "reward", "--reward.judge-parser")
    except ValueError as problem:
        raise error(str(problem)) from None

    def parse(text: str) -> dict[str, float]:
        try:
            score = fn(text)
            return dict(score) if isinstance(score, Mapping) else {"overall": float(score)}
        except Exception as problem:
            raise error(f"--reward.judge-parser {spec!r} raised {problem!r} "
                        f"(the judge's reply: {text!r:.80})") from problem

    return parse
