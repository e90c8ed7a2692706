"""benchmarks/engine/bench_step_profile.py (#57) on the default model, a few tokens: every part of the
decode step it names is timed (the wrappers still reach the methods they wrap), the parts add up to
no more than the step, and the model's layers take the largest share. Timings are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.paths import REPO_ROOT


def test_every_part_of_the_step_is_timed(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "engine" / "bench_step_profile.py"), "--tokens", "12",
           "--prompt-tokens", "8", "--repeats", "1", "--bandwidth", "20", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    med = result["median_us"]
    parts = ("schedule", "batch", "embed+rope", "layers", "logits", "sampler", "update", "outputs")
    assert all(med[p] > 0 for p in parts), {p: med.get(p) for p in parts}
    assert sum(med[p] for p in parts) <= med["step"] <= med["wall"]
    assert med["layers"] == max(med[p] for p in parts)
    assert result["bound_tok_s"] == 20 * 2**30 / result["read_bytes_per_token"]
    assert "| layers |" in done.stdout
