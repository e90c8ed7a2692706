"""Anthropic's Messages API (`/v1/messages`, `count_tokens`): one more adapter over the serving pipeline."""
