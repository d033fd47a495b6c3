"""What a run opts into, each wired into grpo.py by one call: multi-turn episodes against an
environment (env.py, episodes.py) or with tools (tools.py), on-policy distillation
(distillation.py), a reward model (reward_model.py). These may import the step's files; the step's
files never import these."""
