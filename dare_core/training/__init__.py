"""The stage loops (SFT, preference, RL) and what they share: engine setup, checkpoints, metrics, threads."""
