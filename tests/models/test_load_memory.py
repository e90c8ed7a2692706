"""What loading leaves resident (issue #21: the quantized model must be small next to the bf16 one).

Mechanism tests, not RSS thresholds: after load the GGUF file is no longer mapped (its pages would
count in the resident set for as long as any tensor viewed them), and loading imports none of the
heavy modules nothing at load needs (torch._dynamo with triton, sympy: ~100 MiB together; xgrammar:
~20 MiB until the first grammar).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from chatserve.models.gguf import iter_gguf_weights
from chatserve.models.loader import load_hf_config, resolve_model

# Imported by nothing the engine runs at load; each was once pulled in by the load path itself.
HEAVY_MODULES = ("torch._dynamo", "triton", "sympy", "xgrammar", "transformers.models.llama.configuration_llama")


def _mappings_of(path: str) -> list[str]:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return [line for line in f if line.rstrip().endswith(target)]


def test_gguf_file_is_unmapped_once_its_weights_are_read(default_gguf):
    """Every yielded tensor (quantized blocks kept, or de-quantised) owns its memory: with all of
    them still alive, no mapping of the file is left."""
    source = resolve_model(str(default_gguf))
    config = load_hf_config(source)
    kept = frozenset({2, 3, 8})  # Q4_0, Q4_1, Q8_0: the default file's types stay in blocks
    for keep_qtypes in (kept, frozenset()):
        weights = dict(iter_gguf_weights(str(default_gguf), config, torch.bfloat16, keep_qtypes))
        assert weights
        assert _mappings_of(str(default_gguf)) == [], f"keep_qtypes={sorted(keep_qtypes)}: the GGUF is still mapped"
        del weights


_LOAD_SCRIPT = """
import json, sys
import torch
before = set(sys.modules)
from chatserve import LLM
result = {}
for quantization in sys.argv[2:]:
    llm = LLM(model=sys.argv[1], dtype="bfloat16", num_kv_blocks=8, num_threads=1, quantization=quantization)
    result[quantization] = [l for l in open("/proc/self/maps") if l.rstrip().endswith(sys.argv[1])]
    del llm
print(json.dumps({"new": sorted(set(sys.modules) - before), "gguf_maps": result}))
"""


def _load_in_fresh_process(model: Path, *quantizations: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, os.path.realpath(model), *quantizations],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loading_imports_no_heavy_modules_and_leaves_no_mapping(default_gguf):
    """A fresh process (this one has imported everything already): `import torch`, then `LLM(...)`
    with the quantized blocks kept, then again de-quantised. Neither load imports a heavy module (the
    modules new after both are the union of what each imported) or leaves the file mapped.

    Regressions this catches: building the model on meta with nn.init's random init (imports
    torch._dynamo and triton), `to_empty` (sympy), reading the metadata folder with AutoConfig /
    AutoTokenizer without a config (LlamaConfig's module imports sympy and torch.distributed),
    xgrammar imported at engine import, torch's cpp_extension (and with it setuptools: ~0.13 s) imported
    to import a kernel build that is already finished."""
    from chatserve.kernels.cpu import load_cpu_kernels

    result = _load_in_fresh_process(default_gguf, "auto", "none")
    assert [m for m in HEAVY_MODULES if m in result["new"]] == []
    if load_cpu_kernels() is not None:  # built (pytest_sessionstart): the loads import it and compile nothing
        assert "torch.utils.cpp_extension" not in result["new"] and "setuptools" not in result["new"]
    assert "chatserve.engine.llm_engine" in result["new"]  # the set really holds what the loads imported
    assert result["gguf_maps"] == {"auto": [], "none": []}
