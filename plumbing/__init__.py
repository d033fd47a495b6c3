"""Plumbing: what the training loop needs and a reader of RL training never needs to open.

Checkpoints, trackers, metrics, the console, the command line, the memory estimate, balancing ranks, the
attention kernel, the bf16 optimizer, collectives, calls within time limits, the LLM judge and its client, TRL's
reward functions, grading math answers, loading a user's files and the built-in tasks, the data files' checks,
decoding images and videos, the code sandbox, tiny models and the CPU stack's start-up fix. The concept files at the top
level import these modules; these modules never import a concept file (what they need of one, such as the
trainer's batch class or a reward error type, arrives as an argument).
"""
