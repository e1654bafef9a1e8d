"""The configuration reference (docs/configuration.md, linked from the README) is generated from
the models and must match them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"


def _tool():
    tool = ROOT / "tools" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_writes_the_page_this_test_reads():
    assert _tool().REFERENCE == REFERENCE


def test_configuration_reference_matches_the_config_models():
    text = REFERENCE.read_text()
    assert _tool().render(text) == text, "run: python tools/config_reference.py --write"


def test_every_config_key_is_documented():
    from kvci_plugin.connector.config import KVCIConfig

    text = REFERENCE.read_text()
    missing = [k for k in KVCIConfig.model_fields if f"| `{k}` |" not in text]
    assert not missing


def test_the_readme_links_the_reference():
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()
