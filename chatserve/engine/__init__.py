"""The engine: requests in, batched steps, outputs out (LLMEngine, AsyncLLMEngine, input processing, detokenizing)."""
