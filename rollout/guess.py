"""The public path of the built-in number-guessing environment (`env.name: rollout.guess:GuessNumber`); the code
lives in rollout/multiturn/guess.py."""
from rollout.multiturn.guess import GuessNumber, demonstration, opening  # noqa: F401
