"""Grammar-constrained decoding with xgrammar: compile specs off the step loop, one matcher per
sequence, and one batched token bitmask per step applied to the constrained rows only.

- `compiler.GrammarCompilerService`: `StructuredOutputsParams` -> xgrammar `CompiledGrammar`, on a
  small pool of worker threads, behind an LRU cache keyed by the spec and its JSON whitespace; errors are
  `StructuredOutputError` (a ValueError naming the field, e.g. "structured_outputs.regex: ..."). A server
  waits on a compile through a `Ticket` (`acquire`), with a time limit (`GrammarCompileTimeout`,
  `GrammarCompilerBusy`), and a queued compile nobody waits for any more is cancelled.
- `config.StructuredOutputsConfig`: the engine's `structured_outputs_config` (JSON whitespace: a
  bounded run between tokens by default, or none at all).
- `matcher.SequenceMatcher`: one sequence's position in its grammar (advances with each token).
- `bitmask.apply_grammar_bitmask`: the batched fill + apply the sampler calls.
"""

from typing import Any

# Each name from its module on first use: `structured.config` is read by the engine's config (and so
# by the CLI), which must not import torch (bitmask) or xgrammar (compiler, matcher) to build flags.
_EXPORTS = {
    "apply_grammar_bitmask": "bitmask",
    "CompilerStats": "compiler",
    "GrammarCompilerBusy": "compiler",
    "GrammarCompilerService": "compiler",
    "GrammarCompileTimeout": "compiler",
    "StructuredOutputError": "compiler",
    "Ticket": "compiler",
    "StructuredOutputsConfig": "config",
    "parse_structured_outputs_config": "config",
    "SequenceMatcher": "matcher",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"chatserve.structured.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CompilerStats",
    "GrammarCompileTimeout",
    "GrammarCompilerBusy",
    "GrammarCompilerService",
    "SequenceMatcher",
    "StructuredOutputError",
    "StructuredOutputsConfig",
    "Ticket",
    "apply_grammar_bitmask",
    "parse_structured_outputs_config",
]
