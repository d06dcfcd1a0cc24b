"""The one exception type for bad user input: the CLI prints its message and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, data file, reward function): the message names what and how to fix it."""

    exit_code = 2
