"""The built-in tasks, one file each: its rows, its reward, its environment or tools, nothing else.
Nothing imports these by module: plumbing/loading.py finds a task's piece by name (task_piece), so a
new task is one new file here and no edit anywhere else. The names a file may define, and the flag
that finds each:
    rows(split) -> list[dict]   --data.train-files NAME[@split] (rows(split, ARG): NAME:ARG)
    reward(inp, **kwargs)       --reward.function NAME (a `check(**kwargs)` attribute: its start-up
                                check)
    environment (a class)       --rollout.env NAME, in tasks/NAME.py or tasks/NAME_env.py
    tools (a list of functions) --tools.functions NAME, in tasks/NAME.py or tasks/NAME_tools.py
    parser(text) -> calls       --tools.parser NAME, in tasks/NAME.py or tasks/NAME_tools.py
so `--rollout.env toy` is tasks/toy_env.py's ToyVault and `--tools.functions toy`
tasks/toy_tools.py's lookup. A task's rows have the splits train and test (the test split
validates).
"""
