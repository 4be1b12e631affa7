"""Prefect flows: retrain (end to end), the stage job that work pools run, promote, reproduce."""
