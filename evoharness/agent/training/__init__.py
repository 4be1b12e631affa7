"""Training: profiles, the base model, SFT and cost-aware GRPO with TRL."""
