"""Programs run against tests in a sandbox (plumbing/sandbox.py), for code datasets:
`--reward.function code` (`grpo.py toy_code`, `grpo.py code_qwen2_5_coder_1_5b`)."""

import json
import re

from plumbing.sandbox import Limits, protections, run_code
from rewards import RewardError, RewardInput


def extract_code(response: str) -> str:
    """The program in a response: its last ```python (or bare ```) block, else the whole response.

    "Here:\n```python\nprint(1)\n```" -> "print(1)\n"
    """
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", response, re.DOTALL)
    return blocks[-1] if blocks else response


async def reward(inp: RewardInput, seconds: float = 5.0, memory_mib: int = 512,
                 allow_weaker_sandbox: bool = False) -> dict[str, float]:
    """The response's program run in the sandbox against the ground truth's tests:
    `{"tests": [{"input": ..., "output": ...}, ...]}` (stdin to stdout; lines compared without
    trailing spaces) or `{"asserts": [...]}` (Python statements run after the program, in one run),
    or that as a JSON string. overall = the share of tests passed, accuracy = all of them. A test
    that runs past `seconds`, needs more than `memory_mib` MiB, writes outside its folder, opens a
    socket or starts a process fails (plumbing/sandbox.py says how each is stopped).

    tests [{"input": "2 3", "output": "5"}]: "print(sum(map(int, input().split())))" -> overall 1.0;
    "print(6)" -> 0.0; "while True: pass" -> 0.0 (after 5 s).
    """
    truth = (json.loads(inp["ground_truth"]) if isinstance(inp["ground_truth"], str)
             else inp["ground_truth"])
    program, limits = extract_code(inp["response"]), Limits(seconds=seconds, memory_mib=memory_mib)
    if "asserts" in truth:
        outcome = await run_code(program + "\n\n" + "\n".join(truth["asserts"]) + "\n", "", limits)
        passed = [outcome.status == "ok" and outcome.returncode == 0]
    else:
        outcomes = [await run_code(program, test["input"], limits) for test in truth["tests"]]
        passed = [o.status == "ok" and o.returncode == 0
                  and _lines(o.stdout) == _lines(test["output"])
                  for o, test in zip(outcomes, truth["tests"])]
    share = sum(passed) / max(len(passed), 1)
    return {"overall": share, "accuracy": float(share == 1.0)}


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def check_sandbox(allow_weaker_sandbox: bool = False, **limits) -> None:
    """At start-up: the sandbox's protections hold on this machine, or the run is refused, naming
    the missing ones."""
    if not isinstance(allow_weaker_sandbox, bool):
        raise RewardError(f"--reward.kwargs allow_weaker_sandbox {allow_weaker_sandbox!r}: "
                          "give true or false")
    missing = [name for name, held in protections().items() if not held]
    if missing and not allow_weaker_sandbox:
        raise RewardError(f"the code reward's sandbox cannot enforce {', '.join(missing)} on this "
                          "machine (namespaces need root or unprivileged user namespaces, Landlock "
                          "Linux 5.13+); run elsewhere, or accept the weaker sandbox with "
                          "--reward.kwargs allow_weaker_sandbox true")


reward.check = check_sandbox
