#!/usr/bin/env python3
"""Convert a GGUF file into a bf16 safetensors Hugging Face folder (model + tokenizer), once.

Why: vLLM's CPU build serves HF folders (its own GGUF path is experimental and slow), while
chatserve serves the .gguf itself. Converting with transformers' own GGUF loader
(``from_pretrained(dir, gguf_file=...)``) de-quantises the same blocks into the same bf16 values
that chatserve's loader computes, so both servers run the same weights and the same tokenizer
(chat template included) and the comparison measures the engines, not the checkpoints.

    python benchmarks/peers/gguf_to_hf.py MODEL.gguf OUT_DIR            # writes OUT_DIR (skips if complete)
    python benchmarks/peers/gguf_to_hf.py MODEL.gguf OUT_DIR --force    # rewrite it

The folder is written into a temporary sibling and renamed into place at the end, so an
interrupted conversion never leaves a half-written folder that a later run would take as done.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# A folder holding these is complete: written last by save_pretrained, renamed in one step.
REQUIRED_FILES = ("config.json", "tokenizer_config.json")
STAMP = "converted_from.json"


def is_complete(out: Path, gguf: Path) -> bool:
    """True when out was converted from this very file (same path, size and mtime)."""
    stamp = out / STAMP
    if not stamp.is_file() or not all((out / f).is_file() for f in REQUIRED_FILES):
        return False
    if not any(out.glob("*.safetensors")):
        return False
    try:
        meta = json.loads(stamp.read_text())
    except ValueError:
        return False
    st = gguf.stat()
    return meta.get("gguf") == str(gguf) and meta.get("size") == st.st_size and meta.get("mtime") == st.st_mtime


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        kwargs = {"gguf_file": gguf.name}
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.bfloat16, **kwargs)
        # NOTE: transformers de-quantises every GGUF tensor into a plain bf16 nn.Linear at load, but keeps
        # its GGUF "quantizer" marker, and save_pretrained refuses any model that has one ("quantized with
        # gguf and is not serializable"). The weights are plain tensors by now: drop the marker and save.
        if any(type(t).__name__ != "Parameter" or t.dtype != torch.bfloat16 for t in model.parameters()):
            raise SystemExit(f"{gguf.name}: transformers left some weights packed or not bf16; cannot convert")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.dtype = torch.bfloat16
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if not getattr(tok, "chat_template", None):
            print(f"warning: {gguf.name} carries no chat template; vLLM will refuse chat requests", file=sys.stderr)
        st = gguf.stat()
        (tmp / STAMP).write_text(json.dumps({"gguf": str(gguf), "size": st.st_size, "mtime": st.st_mtime,
                                             "dtype": "bfloat16"}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path, help="the .gguf file")
    p.add_argument("out", type=Path, help="the HF folder to write")
    p.add_argument("--force", action="store_true", help="convert even if out is already complete")
    args = p.parse_args(argv)
    gguf = args.gguf.resolve()
    out = args.out.expanduser().resolve()
    if not gguf.is_file():
        p.error(f"gguf: no such file: {gguf}")
    if not args.force and is_complete(out, gguf):
        print(f"{out}: already converted from {gguf.name}")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    convert(gguf, out)
    print(f"{out}: converted from {gguf.name} (bf16 safetensors + tokenizer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
