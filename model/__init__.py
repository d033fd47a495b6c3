"""What the trainer adapts of a model: vision-language families (vision.py), LoRA adapters
(lora.py), sequence parallelism (sequence_parallel.py) and what differs between model families
(families.py). The step's files import these; these import only each other and plumbing/."""
