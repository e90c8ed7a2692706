"""Grammar-constrained decoding with xgrammar: compile specs off the step loop, one matcher per
sequence, and one batched token bitmask per step applied to the constrained rows only.

- `compiler.GrammarCompilerService`: `StructuredOutputsParams` -> xgrammar `CompiledGrammar`, in a
  worker thread, behind an LRU cache keyed by the spec and its JSON whitespace; errors are `StructuredOutputError` (a
  ValueError naming the field, e.g. "structured_outputs.regex: ...").
- `config.StructuredOutputsConfig`: the engine's `structured_outputs_config` (JSON whitespace: a
  bounded run between tokens by default, or none at all).
- `matcher.SequenceMatcher`: one sequence's position in its grammar (advances with each token).
- `bitmask.apply_grammar_bitmask`: the batched fill + apply the sampler calls.
"""

from chatserve.structured.bitmask import apply_grammar_bitmask
from chatserve.structured.compiler import CompilerStats, GrammarCompilerService, StructuredOutputError
from chatserve.structured.config import StructuredOutputsConfig, parse_structured_outputs_config
from chatserve.structured.matcher import SequenceMatcher

__all__ = [
    "CompilerStats",
    "GrammarCompilerService",
    "SequenceMatcher",
    "StructuredOutputError",
    "StructuredOutputsConfig",
    "apply_grammar_bitmask",
    "parse_structured_outputs_config",
]
