"""Every shipped recipe loads and validates."""
import glob
import os

import pytest

from rlhf.config import load_config
from tests.conftest import ROOT

EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, ROOT))
def test_example_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.output_dir
