"""rlhf: config, controller, data, checkpoints, logging and the command-line entry point."""
