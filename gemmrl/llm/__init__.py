"""LLM-written kernels (issue #6): an OpenAI-compatible client, prompts with retrieved examples,
a static check of untrusted source, a sandboxed build, and the multi-turn refinement loop that
records every turn as a trajectory for RL fine-tuning. No torch, no GPU at import time."""
