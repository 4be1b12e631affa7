"""The agent: ALFWorld games and engine, the BPE harness, policies and decoding, the episode engine and its environment
pool, the reward, rollouts, evaluation and training (SFT, cost-aware GRPO). It imports nothing of ``ops``."""
