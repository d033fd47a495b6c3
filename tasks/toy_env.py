"""The built-in environment task "open the vault": `torchrun --nproc_per_node 2 grpo.py toy_env`
(--data.train-files toy_env, --rollout.env toy, --reward.function env). The default job's task,
told by the environment: the prompt says nothing of the code."""

from plumbing.loading import task_piece


def rows(split: str) -> list[dict]:
    """The prompt is a made-up four-letter word (toy_tools's), the answer a digit, the vault's code;
    `clue` is what the vault says to the model's first turn, 7 digits of which 4 are the code (toy's
    prompt). train: 1024 rows, test: 50, seeded.

    >>> rows("test")[0]
    {'problem': 'eszy', 'answer': '2', 'clue': '2221512'}
    """
    if split not in ("train", "test"):
        raise ValueError(f"the toy_env dataset has the splits 'train' and 'test', not {split!r}")
    words = [row["problem"] for row in task_piece("toy_tools", "rows")(split)]
    return [{"problem": word, "answer": row["answer"], "clue": row["problem"]}
            for word, row in zip(words, task_piece("toy", "rows")(split))]


class ToyVault:
    """The vault opens to a digit that only the environment knows. Whatever the model says first,
    the vault answers with a clue, 7 digits of which 4 are the code (the row's `clue`); the model
    opens it by answering the code, alone, in its next turn. The prompt says nothing of the code, so
    the answer needs the environment's. It keeps the score (`reward`): 0.5 for the right digit
    first, 0.5 more for stopping right there, as the default job's task.

    code 5, clue "5255275": turns "hi", then "5" -> reward 1.0; "55" -> 0.5; "2" -> 0.0.
    """

    def reset(self, answer: str, clue: str) -> None:
        self.code, self.clue, self.turns, self.reward = answer, clue, 0, 0.0

    def respond(self, turn: str) -> str | None:
        self.turns += 1
        if self.turns == 1:
            return self.clue
        answer = turn.strip()
        right = float(answer.startswith(self.code))
        self.reward = 0.5 * right + 0.5 * right * float(answer == self.code)
        return None


environment = ToyVault
