"""What a run writes into its output folder and reads back: checkpoints, metrics, the console, the run's identity."""
