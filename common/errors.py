"""The exceptions the CLI turns into a message without a traceback: bad user input (exit code 2) and a run that
stopped itself (exit code 3)."""


class UserError(Exception):
    """Bad input from the user (config, data file, reward function): the message names what and how to fix it."""

    exit_code = 2


class TrainingStopped(Exception):
    """The run stopped itself (e.g. too many consecutive NaN/Inf steps); the last checkpoint is intact."""

    exit_code = 3
