"""benchmarks/gpu/gpu_check.py's bookkeeping, without a GPU: how the invariance section compares runs and
what its MISMATCH rows do to the exit status, and the refusals of bad options.

The script itself needs an NVIDIA GPU; `python benchmarks/gpu/gpu_check.py --smoke --sections invariance`
dry-runs it on the CPU with Triton's interpreter (about a minute), which is too slow for this suite.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def test_agreement_counts_identical_replies_and_finds_the_earliest_divergence(gpu_check):
    base = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert gpu_check.agreement(base, [list(r) for r in base]) == (3, "none differ")
    # prompt 0 differs at token 2, prompt 1 at token 1: the earliest is reported
    assert gpu_check.agreement(base, [[1, 2, 0], [4, 0, 6], [7, 8, 9]]) == (1, "first at token 1 (prompt 1)")
    # logprobs compare as floats: equal bits or not
    assert gpu_check.agreement([[-0.5, -1.25]], [[-0.5, -1.2500001]]) == (0, "first at token 1 (prompt 0)")


def test_agreement_refuses_runs_of_different_sizes(gpu_check):
    with pytest.raises(ValueError):
        gpu_check.agreement([[1], [2]], [[1]])


def test_mismatch_rows_are_counted_and_fail_the_run_only_when_strict(gpu_check):
    Row = gpu_check.Row
    report = gpu_check.Report(budget_s=60.0)
    report.add(Row("invariance", "engine bfloat16 (4)", verdict="differs (info)"))
    report.add(Row("invariance", "engine bfloat16 (2)", verdict="ok (identical; logprobs differ)"))
    assert report.mismatches == 0
    report.add(Row("invariance", "engine bfloat16 (3)", verdict="MISMATCH vs (1)"))
    assert report.mismatches == 1 and not report.failed
    assert gpu_check.exit_status(report, strict_invariance=False) == 0
    assert gpu_check.exit_status(report, strict_invariance=True) == 1
    report.add(Row("kernels", "decode", verdict="FAIL (unwritten=3, within tol=True)"))
    assert gpu_check.exit_status(report, strict_invariance=False) == 1


def test_a_part_that_raises_becomes_an_error_row_and_the_run_goes_on(gpu_check):
    report = gpu_check.Report(budget_s=60.0)
    report.guarded("invariance", "engine float32", lambda: 1 / 0)
    report.guarded("invariance", "too long", lambda: pytest.fail("must be skipped"), needs_s=1e6)
    assert report.failed
    assert report.rows[0].verdict.startswith("ERROR ZeroDivisionError")
    assert report.rows[1].verdict.startswith("skipped")


@pytest.mark.parametrize(
    "argv, message",
    [(["--sections", "kernels,bogus"], "unknown sections ['bogus']"), (["--invariance-tokens", "0"], "must be >= 1")],
)
def test_bad_options_are_refused_before_anything_runs(gpu_check, capsys, argv, message):
    assert gpu_check.main(argv) == 2
    assert message in capsys.readouterr().err


def test_layout_note_reads_the_step_layout_from_two_stats_snapshots(gpu_check):
    """Scenario (4)'s note: what the engine's public counters moved by between the snapshots, not their totals."""
    before = {"num_steps": 10, "num_prefill_chunks_continued": 3, "num_mixed_steps": 1, "num_preemptions": 0}
    after = {"num_steps": 17, "num_prefill_chunks_continued": 7, "num_mixed_steps": 3, "num_preemptions": 5}
    assert gpu_check.layout_note(before, after) == "7 steps, 4 chunks continuing a prompt, 2 steps with decodes + chunks"
