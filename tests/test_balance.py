"""plumbing/balance.py: the deal by hand, then the exchange under torchrun (2 ranks, gloo) with every kind of row data.
That the gradient is unchanged by balancing is checked with the other distributed invariants (test_algorithms.py)."""

import json
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, free_port
from logprobs import make_batch
from plumbing.balance import deal


def test_the_docstring_example():
    assert deal([[9, 8], [1, 2]], mini_batch=2) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]


def test_sequences_never_change_mini_batch_and_every_rank_keeps_its_count():
    # mini-batch 0 (rows 0-1): 17 + 3 tokens -> 10 + 10; mini-batch 1 (rows 2-3): 2 + 14 -> 8 + 8
    lengths = [[9, 8, 1, 1], [1, 2, 7, 7]]
    assert deal(lengths, mini_batch=2) == [[(0, 0), (1, 0), (0, 2), (1, 2)], [(0, 1), (1, 1), (0, 3), (1, 3)]]


def test_longest_first_onto_the_lightest_rank_with_room():
    # 3 ranks of 13, 13, 7 tokens: the two 9s go to ranks 0 and 1, the three 3s fill rank 2, then 2, 2, 1, 1
    assert deal([[9, 1, 3], [1, 9, 3], [2, 2, 3]], mini_batch=3) == [[(0, 0), (0, 1), (2, 0)],
                                                                   [(1, 0), (1, 1), (2, 1)],
                                                                   [(0, 2), (1, 2), (2, 2)]]


def test_a_mini_batch_that_would_not_gain_enough_stays_where_it_is():
    assert deal([[5, 5], [5, 5]], mini_batch=2) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    # mini-batch 0 even (left alone), mini-batch 1 uneven (dealt: 2 + 18 tokens -> 10 + 10)
    assert deal([[4, 6, 1, 1], [6, 4, 9, 9]], mini_batch=2) == [[(0, 0), (0, 1), (0, 2), (1, 2)],
                                                                [(1, 0), (1, 1), (0, 3), (1, 3)]]
    # one sequence per rank: no deal can lower the heaviest rank
    assert deal([[1], [9]], mini_batch=1) == [[(0, 0)], [(1, 0)]]
    # 41 + 39 tokens could become 40 + 40: 2.4% less on the heaviest rank, under MIN_GAIN, not worth an exchange
    assert deal([[20, 21], [20, 19]], mini_batch=2) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]


def test_a_row_travels_without_the_rest_of_its_batch():
    """A row's cut of a [B, R] tensor is a view; pickled as it is, it would carry the whole tensor."""
    batch = make_batch([[1, 2]] * 64, [[3] * 2000] + [[4] * 3] * 63, pad_id=0)
    batch.advantages = torch.ones(batch.response_mask.shape)  # [64, 2000]: 512 kB
    assert len(pickle.dumps(batch.row(1))) < 2000


WORKER = """
import json, sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from plumbing.balance import balance_over_ranks
from logprobs import make_batch

dist.init_process_group("gloo")
rank = dist.get_rank()
# row id k: prompt [1, k], response of k tokens (k + 100, ...), engine log-prob -k/10 per token, advantage k on each
# token, an image tensor filled with k on odd rows; rank 0 holds the long responses
ids = [7, 8, 5, 6] if rank == 0 else [1, 2, 3, 4]
batch = make_batch([[1, k] for k in ids], [[k + 100] * k for k in ids], 0, [[-k / 10] * k for k in ids], "cpu",
                   [{{"pixel_values": torch.full((2, 3), float(k))}} if k % 2 else None for k in ids])
batch.advantages = torch.tensor([[float(k)] * k + [0.0] * (8 - k) for k in ids])[:, : batch.response_mask.shape[1]]
new = balance_over_ranks(batch, mini_batch=2, pad_id=0)
old, moved = new.old_logprobs, new.advantages
rows = []
for i in range(len(new.prompt_lengths)):
    p, r = new.prompt_lengths[i], new.response_lengths[i]
    vision = new.vision[i]
    rows.append({{"prompt": new.input_ids[i, :p].tolist(), "response": new.input_ids[i, p:p + r].tolist(),
                 "padding": new.input_ids[i, p + r:].tolist(), "mask": new.response_mask[i].tolist(),
                 "engine": new.rollout_logprobs[i].tolist(), "advantages": moved[i].tolist(),
                 "image": None if vision is None else vision["pixel_values"].flatten().tolist()}})
gathered = [None, None]
dist.all_gather_object(gathered, {{"old": old, "rows": rows}})
if rank == 0:
    open(sys.argv[1], "w").write(json.dumps(gathered))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_rows_move_whole_between_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    assert all(r["old"] is None for r in ranks)  # a None tensor stays None
    held = [[row["prompt"][1] for row in r["rows"]] for r in ranks]
    # sequences of k + 2 tokens. Mini-batch 0: 7, 8 | 1, 2 (19 + 7 tokens) -> 8, 1 | 7, 2 (13 + 13);
    # mini-batch 1: 5, 6 | 3, 4 (15 + 11) -> 6, 3 | 5, 4 (13 + 13)
    assert held == [[8, 1, 6, 3], [7, 2, 5, 4]]
    for rows in (r["rows"] for r in ranks):
        width = max(row["prompt"][1] for row in rows)  # each rank's batch is as wide as its longest response
        for row in rows:
            k = row["prompt"][1]
            assert row["prompt"] == [1, k] and row["response"] == [k + 100] * k and set(row["padding"]) <= {0}
            assert row["mask"] == [1.0] * k + [0.0] * (width - k)
            assert row["engine"] == pytest.approx([-k / 10] * k + [0.0] * (width - k))
            assert row["advantages"] == [float(k)] * k + [0.0] * (width - k)
            assert row["image"] == ([float(k)] * 6 if k % 2 else None)

