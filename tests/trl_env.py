"""An environment in TRL's `environment_factory` shape, as TRL's OpenEnv guide writes one (its echo environment, here
without a server), for `--rollout.env tests/trl_env.py:Echo` (tests/test_episodes.py): it imports nothing of this
project. A random model never writes a real `<tool_call>`, so the run's parser, `every_turn`, reads every turn as a
call of the environment's tool with the turn's text."""

from features.tools import ToolCall


class Echo:
    def reset(self, **kwargs) -> str | None:
        self.target, self.reward = kwargs["answer"], 0.0
        return f" Echo {self.target}."

    def echo(self, message: str) -> str:
        """Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self.reward = float(message.strip() == self.target)
        return message


def every_turn(text: str) -> list[ToolCall]:
    return [ToolCall("echo", {"message": text}, source=text)]
