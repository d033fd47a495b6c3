"""Commands run on a finished (or running) run: `python -m scripts.merge`, `python -m scripts.plot`."""
