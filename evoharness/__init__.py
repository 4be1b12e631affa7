"""EvoHarness Ops: the production pipeline around EvoHarness-RL (BPE harness + cost-aware GRPO) on ALFWorld."""

__version__ = "0.1.0"
