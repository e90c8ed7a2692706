"""Speculative decoding without a second model: drafters guess the next tokens, the engine verifies
them in one forward pass and keeps the longest prefix that plain decoding would have produced.

Layer: below the engine, beside ``core`` (torch-free; the scheduler is handed a proposer, it does not
import this package). ``config`` parses vLLM's ``speculative_config``; one file per drafter
(``ngram`` prompt lookup, ``suffix`` trees over this request and recent outputs; a draft model
would be one more); ``proposer`` picks the draft length per sequence and step; ``acceptance``
turns verified rows into accepted tokens.
"""
