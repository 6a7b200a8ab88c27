"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def model_dir(tmp_path):
    """A model folder the config checks accept (the fake doors never load it)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(tmp_path)
