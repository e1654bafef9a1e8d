"""The README's configuration reference is generated from the models and must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_reference_matches_the_config_models():
    text = (ROOT / "README.md").read_text()
    assert _tool().render(text) == text, "run: python tools/config_reference.py --write"


def test_every_config_key_is_documented():
    from kvci_plugin.connector.config import KVCIConfig

    text = (ROOT / "README.md").read_text()
    missing = [k for k in KVCIConfig.model_fields if f"| `{k}` |" not in text]
    assert not missing
