"""The exceptions the CLI turns into a message without a traceback: bad user input (exit code 2) and a run that
stopped itself (exit code 3); and the hint for a user module whose own `common` this project's package shadows."""
import os
import sys

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class UserError(Exception):
    """Bad input from the user (config, data file, reward function): the message names what and how to fix it."""

    exit_code = 2


class TrainingStopped(Exception):
    """The run stopped itself (e.g. too many consecutive NaN/Inf steps); the last checkpoint is intact."""

    exit_code = 3


def shadowed_import(error: ImportError, wanted: str) -> str:
    """'' unless `error`, raised importing the user's module `wanted`, comes from one of the user's own modules that a
    package of this project (`common`, `rollout`, ...) shadows, having been imported first under that name; then a
    sentence saying so and the fix."""
    name = getattr(error, "name", None) or ""
    top = name.split(".")[0]
    if not top or top == wanted.split(".")[0]:  # the user asked for this project's module itself
        return ""
    where = getattr(error, "path", None) or getattr(sys.modules.get(top), "__file__", None) or ""
    if not os.path.abspath(where).startswith(PROJECT_ROOT + os.sep):
        return ""
    return (f"; the {top!r} it imports from is this project's package {top!r} ({os.path.dirname(where)}), imported "
            f"first under that name: rename your own {top}.py (e.g. my_{top}.py), or import it relatively from "
            "within your package")


def load_named(spec: str, key: str, form: str):
    """The object `spec` names as `package.module:attribute` (config key `key`, which a user writes as `form`);
    UserError saying which part is wrong and how to fix it."""
    import importlib
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise UserError(f"{key} = {spec!r}: write it as {form}")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise UserError(f"{key} = {spec!r}: cannot import {module!r} ({e})"
                        f"{shadowed_import(e, module) or '; is it on PYTHONPATH?'}") from None
    except AttributeError:
        raise UserError(f"{key} = {spec!r}: module {module!r} has no {attr!r}") from None
