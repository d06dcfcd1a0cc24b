"""The RL stage: the controller and its rounds, which workers start and where they go, the checks before they do."""
