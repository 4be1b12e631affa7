"""Datasets: SFT pairs from teacher trajectories, and the Great Expectations gate on both."""
