"""The proxy node service: OpenAI-compatible pass-through, control plane and mock engine."""
