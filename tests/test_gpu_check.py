"""benchmarks/gpu_check.py at toy sizes on the CPU: the script a GPU session runs is itself tested here."""

import json
import subprocess
import sys

import pytest

from conftest import ENGINE_GAP, ROOT

pytestmark = pytest.mark.slow  # every test here launches processes


def test_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, json.dumps(report, indent=2) + proc.stderr[-3000:]
    assert report["device"] == "cpu" and "devices" not in report  # the suite runs test_devices.py itself
    assert report["logprobs"]["tokens"] > 0 and report["logprobs"]["logprob_gap_max"] < ENGINE_GAP
    assert report["job"]["steps"] == 2 and report["job"]["engine_gap_max"] < ENGINE_GAP
    update = report["update"]
    assert update["tokens"] == 8 * 32 and update["tokens_per_s"] > 0 and update["mfu"] is None
    assert update["distill_forward_kl_update_s"] > 0 and "distill_forward_kl_peak_memory_gib" in update
    paths = report["paths"]
    assert paths["packed_vs_padded_max"] < 1e-4 and paths["attention"] == "packed_sdpa"
    attention = paths["attention_paths"]  # on a CPU only packed_sdpa runs; the others say why not
    assert attention["packed_sdpa"]["forward_backward_s"] > 0 and attention["packed_sdpa"]["vs_packed_sdpa_max"] == 0
    assert attention["packed_varlen"] == attention["flash_attention_2"] == "GPU only"
    assert (paths["nondeterminism_max"] == paths["offload_weight_diff_max"]
            == paths["fsdp_cpu_offload_weight_diff_max"] == 0.0)
    assert paths["fsdp_cpu_offload_streamed"] > 0 and paths["reference_after_reshard_gib"] == 0.0
    kernels = report["kernels"]  # on a CPU: the linear-attention reference alone, the window on packed_sdpa alone
    linear, window = kernels["linear_attention"], kernels["sliding_window"]
    assert linear["kernels"] == {"fla": "GPU only", "causal-conv1d": "GPU only"} and "kernels_run" not in linear
    assert linear["reference"]["forward_backward_s"] > 0 and linear["reference"]["tokens"] == 8 * 32
    assert window["packed_sdpa"]["vs_dense_max"] < 1e-5
    assert window["packed_varlen"] == window["flash_attention_2"] == "GPU only"
    chunk = kernels["head_chunk"]
    assert chunk["entropy_with_gradient"]["forward_backward_s"] > 0 and "peak_memory_gib" in chunk["entropy_value_only"]
    link = report["link"]  # the separate placement's weight path, trainer rank 0 alone
    assert link["store_version"] == 1 and link["gib"] > 0 and link["publish_s"] > 0
