"""The pure logic of issue #21's benchmark tooling: bench_offline.py's llama.cpp table and PASS/FAIL
targets, its engine selection and llama.cpp context size, and bench_serving.py's --grid table.
Fabricated results only: nothing here runs an engine, llama.cpp or a server, and no wall-clock
number is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

BENCHMARKS = REPO_ROOT / "benchmarks"


def _load(path: str):
    if str(BENCHMARKS) not in sys.path:  # their one helpers module, bench_common
        sys.path.insert(0, str(BENCHMARKS))
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(f"_test_{name}", BENCHMARKS / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


bo = _load("peers/bench_offline.py")
bs = _load("serving/bench_serving.py")


def _res(**kw) -> dict:
    base = {"prefill_ttft_s": 1.0, "prefill_tok_s": 1000.0, "bs1_ttft_s": 0.05, "bs1_decode_tok_s": 100.0,
            "bs32_tok_s": 500.0, "rss_after_load_mib": 500.0, "peak_rss_mib": 600.0, "load_s": 1.0, "import_s": 1.0}
    base.update(kw)
    return base


def _by_target(targets: list[dict]) -> dict[str, dict]:
    return {t["target"]: t for t in targets}


def test_targets_pass_and_fail() -> None:
    results = {
        "chatserve": _res(bs1_decode_tok_s=160.0, bs32_tok_s=600.0, prefill_ttft_s=0.9, rss_after_load_mib=290.0),
        "chatserve[none]": _res(),
        "llamacpp": _res(bs1_decode_tok_s=100.0, bs1_internal_decode_tok_s=120.0),
    }
    t = _by_target(bo.issue21_targets(results, ["auto", "none"]))
    assert t["decode tok/s, batch 1"]["result"] == "PASS"  # 1.6x >= 1.5x
    assert t["decode tok/s, batch 1"]["ratio"] == pytest.approx(1.6)
    assert t["decode tok/s, batch 1 vs llama.cpp internal eval"]["result"] == "FAIL"  # 160/120 < 1.5
    assert t["decode throughput tok/s, batch B"]["result"] == "PASS"
    assert t["prefill TTFT, P-token prompt (s)"]["result"] == "PASS"  # 0.9 <= 1.0
    assert t["RSS after load (MiB)"]["result"] == "PASS"  # 0.58 <= 0.60

    results["chatserve"].update(bs1_decode_tok_s=140.0, bs32_tok_s=400.0, prefill_ttft_s=1.2, rss_after_load_mib=310.0)
    t = _by_target(bo.issue21_targets(results, ["auto", "none"]))
    assert {k: v["result"] for k, v in t.items()} == {
        "decode tok/s, batch 1": "FAIL",
        "decode tok/s, batch 1 vs llama.cpp internal eval": "FAIL",
        "decode throughput tok/s, batch B": "FAIL",
        "prefill TTFT, P-token prompt (s)": "FAIL",
        "RSS after load (MiB)": "FAIL",
    }


def test_targets_missing_sides_are_na() -> None:
    # No llama.cpp, and `none` not run: nothing to compare against.
    t = _by_target(bo.issue21_targets({"chatserve": _res()}, ["auto"]))
    assert {v["result"] for v in t.values()} == {"n/a"}
    # A failed worker (error, no numbers) is n/a too, not FAIL.
    results = {"chatserve": _res(), "chatserve[none]": {"error": "boom"}, "llamacpp": _res()}
    t = _by_target(bo.issue21_targets(results, ["auto", "none"]))
    assert t["RSS after load (MiB)"]["result"] == "n/a"
    assert t["decode tok/s, batch 1"]["result"] in ("PASS", "FAIL")


def test_targets_quantized_is_first_non_none() -> None:
    # none first, int8 second: int8 is still the quantized side, under "chatserve[int8]".
    results = {"chatserve": _res(), "chatserve[int8]": _res(rss_after_load_mib=100.0)}
    t = _by_target(bo.issue21_targets(results, ["none", "int8"]))
    assert t["RSS after load (MiB)"]["quantized"] == "chatserve (int8)"
    assert t["RSS after load (MiB)"]["ratio"] == pytest.approx(0.2)
    assert t["RSS after load (MiB)"]["result"] == "PASS"


def test_targets_table_text() -> None:
    results = {"chatserve": _res(bs1_decode_tok_s=200.0), "chatserve[none]": _res(), "llamacpp": _res()}
    text = bo.targets_table(bo.issue21_targets(results, ["auto", "none"]), prefill_tokens=1000, batch_size=32)
    lines = text.splitlines()
    assert lines[0].startswith("| issue #21 target")
    assert any("prefill TTFT, 1000-token prompt" in ln for ln in lines)
    assert any("batch 32" in ln for ln in lines)
    row = next(ln for ln in lines if ln.startswith("| decode tok/s, batch 1 "))
    assert "2.00x" in row and ">= 1.50x" in row and "PASS" in row


def test_llamacpp_table_columns_and_ratios() -> None:
    results = {
        "chatserve": _res(bs1_decode_tok_s=150.0, bs1_token_ids=[1, 2, 3, 4]),
        "chatserve[none]": _res(),
        "llamacpp": _res(bs1_decode_tok_s=100.0, bs1_internal_decode_tok_s=125.0, prefill_internal_tok_s=800.0,
                         bs1_token_ids=[1, 2, 9, 9]),
    }
    text = bo.llamacpp_table(results, ["auto", "none"], prefill_tokens=1000, batch_size=32)
    lines = text.splitlines()
    assert "chatserve (auto)" in lines[0] and "chatserve (none)" in lines[0] and "llama.cpp" in lines[0]
    decode = next(ln for ln in lines if ln.startswith("| decode tok/s, batch 1 "))
    assert "1.50x" in decode
    internal = next(ln for ln in lines if "internal eval tok/s" in ln)
    assert "125.0" in internal and "1.20x" in internal  # chatserve's API rate / llama.cpp's internal one
    assert any("2 of 4 tokens" in ln for ln in lines)


def test_llamacpp_table_alone() -> None:
    text = bo.llamacpp_table({"llamacpp": _res()}, ["auto"], prefill_tokens=64, batch_size=4)
    assert "chatserve" not in text.splitlines()[0]
    assert "64-token prompt" in text


def test_chatserve_key() -> None:
    assert bo.chatserve_key("auto", ["auto", "none"]) == "chatserve"
    assert bo.chatserve_key("none", ["auto", "none"]) == "chatserve[none]"


def test_parse_engines() -> None:
    p = argparse.ArgumentParser()

    def ns(**kw) -> argparse.Namespace:
        d = {"only": None, "engines": bo.DEFAULT_ENGINES, "skip_hf": False}
        d.update(kw)
        return argparse.Namespace(**d)

    assert bo.parse_engines(p, ns()) == ["hf", "chatserve"]
    assert bo.parse_engines(p, ns(engines="llamacpp,chatserve,hf")) == ["hf", "chatserve", "llamacpp"]
    assert bo.parse_engines(p, ns(engines="hf,chatserve,llamacpp", skip_hf=True)) == ["chatserve", "llamacpp"]
    assert bo.parse_engines(p, ns(only="llamacpp")) == ["llamacpp"]
    with pytest.raises(SystemExit):
        bo.parse_engines(p, ns(engines="chatserve,vllm"))


def test_llamacpp_n_ctx_fits_the_workload() -> None:
    work = {"prefill_prompt": [0] * 1000, "short_prompt": [0] * 17, "batch_prompts": [[0] * 10, [0] * 40]}
    n = bo.llamacpp_n_ctx(work, 128)
    assert n % 256 == 0 and n >= 1001
    work["prefill_prompt"] = [0] * 64
    assert bo.llamacpp_n_ctx(work, 8) == 512
    assert bo.llamacpp_n_ctx(work, 2000) >= 2040


def _summary(label: str, conc: int, ttft: float, itl: float, tps: float) -> dict:
    d = {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3, "mean": ttft}
    i = {"p50": itl, "p90": itl * 2, "p99": itl * 3, "mean": itl}
    return {"label": label, "settings": {"concurrency": conc}, "ttft_ms": d, "itl_ms": i,
            "output_tokens_per_s": tps, "num_completed": 4, "num_requests": 4}


def test_grid_table() -> None:
    runs = [_summary("q", 1, 50.0, 10.0, 100.0), _summary("q", 16, 200.0, 20.0, 400.0),
            _summary("bf16", 1, 100.0, 20.0, 50.0), _summary("bf16", 16, 100.0, 40.0, 800.0)]
    text = bs.grid_table(runs)
    lines = text.splitlines()
    assert lines[0].split("|")[2].strip() == "q" and lines[0].split("|")[3].strip() == "bf16"
    assert "ratio q vs bf16" in lines[0]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[2:]}
    assert rows["1: TTFT p50 (ms)"] == ["50", "100", "2.00x"]  # lower latency: q better
    assert rows["16: TTFT p50 (ms)"] == ["200", "100", "0.50x"]
    assert rows["1: output tokens/s"] == ["100.0", "50.0", "2.00x"]  # higher throughput: q better
    assert rows["16: ITL p90 (ms)"] == ["40.0", "80.0", "2.00x"]
    assert rows["1: completed / requests"] == ["4/4", "4/4", ""]
    # Concurrency blocks in ascending order, 1 before 16.
    assert [ln.split("|")[1].strip().split(":")[0] for ln in lines[2:]][0] == "1"


def test_grid_table_missing_run() -> None:
    text = bs.grid_table([_summary("q", 4, 50.0, 10.0, 100.0), _summary("bf16", 1, 100.0, 20.0, 50.0)])
    row = next(ln for ln in text.splitlines() if ln.startswith("| 4: TTFT p50"))
    assert [c.strip() for c in row.split("|")[2:-1]] == ["50", "-", "-"]


def test_variants_and_issue30_targets() -> None:
    assert bo.parse_variant("auto", "bfloat16") == ("auto", "bfloat16", "auto")
    assert bo.parse_variant("none:float32:none", "bfloat16") == ("none", "float32", "none")
    assert bo.parse_variant("auto::avx2", "bfloat16") == ("auto", "bfloat16", "avx2")
    quants = ["auto", "none:float32:none"]
    results = {
        "chatserve": _res(bs1_decode_tok_s=130.0, bs32_tok_s=600.0, prefill_ttft_s=2.0, rss_after_load_mib=300.0),
        "chatserve[none:float32:none]": _res(bs1_decode_tok_s=14.0, bs32_tok_s=300.0, prefill_ttft_s=2.8,
                                             rss_after_load_mib=700.0),
        "llamacpp": _res(bs1_decode_tok_s=80.0, prefill_ttft_s=7.3),
    }
    t = _by_target(bo.issue30_targets(results, quants))
    assert t["decode tok/s, batch 1"]["result"] == "PASS"  # 130 / 80 = 1.63x
    assert t["decode throughput tok/s, batch B"]["result"] == "PASS"
    assert t["prefill TTFT, P-token prompt (s)"]["result"] == "PASS"  # 2.0 <= 2.8
    assert t["prefill TTFT, P-token prompt, vs llama.cpp (s)"]["result"] == "PASS"  # 2.0 / 7.3 <= 0.5
    assert t["RSS after load (MiB)"]["result"] == "PASS"
    results["chatserve"].update(bs1_decode_tok_s=110.0, prefill_ttft_s=3.7)
    t = _by_target(bo.issue30_targets(results, quants))
    assert t["decode tok/s, batch 1"]["result"] == "FAIL"  # 1.375x < 1.5x
    assert t["prefill TTFT, P-token prompt (s)"]["result"] == "FAIL"
    assert t["prefill TTFT, P-token prompt, vs llama.cpp (s)"]["result"] == "FAIL"  # 0.51 > 0.5
    assert all(v["result"] == "n/a" for v in bo.issue30_targets({"chatserve": _res()}, ["auto"]))
