"""Evaluation: the OpenCompass run of the eval stage, its report, and in-loop RL validation."""
