"""The built-in tasks, one file each: its rows, its reward, its environment or tools, nothing else.
Nothing imports these by module: plumbing/loading.py finds one by name (--data.train-files toy,
--reward.function toy, --rollout.env toy)."""
