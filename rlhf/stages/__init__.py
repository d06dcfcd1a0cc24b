"""What every stage runs on (the training loop, data, tasks, evaluation) and the one-process stages: SFT, DPO, RM."""
