"""kvci as a vLLM plugin: the `vllm.general_plugins` entry point registers the connector names, so
`{"kv_connector": "KVCheckpointConnector", "kv_role": "kv_both"}` resolves without
`kv_connector_module_path` (which keeps working). An engine started that way, in a fresh
environment: tests/test_install.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from kvci_plugin.plugin import CONNECTORS, ENTRY_POINT_GROUP, ENTRY_POINT_NAME, register

ROOT = Path(__file__).resolve().parents[1]


def test_the_entry_point_is_declared_and_installed():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][ENTRY_POINT_GROUP] == {
        ENTRY_POINT_NAME: "kvci_plugin.plugin:register"}
    installed = [
        ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME
    ]
    assert [ep.value for ep in installed] == ["kvci_plugin.plugin:register"], \
        "reinstall kvci (make setup) to install its entry point"


def test_register_is_idempotent_and_resolves_every_name():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # vLLM may load plugins more than once per process
    from kvci_plugin.connector import KVCheckpointConnector

    assert (
        KVConnectorFactory.get_connector_class_by_name("KVCheckpointConnector")
        is KVCheckpointConnector
    )
    assert set(CONNECTORS) <= set(KVConnectorFactory._registry)


def test_vllm_resolves_the_short_config_and_the_module_path():
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from kvci_plugin.connector import KVCheckpointConnector

    load_general_plugins()  # what vLLM runs in each of its processes
    short = KVTransferConfig(kv_connector="KVCheckpointConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(short) is KVCheckpointConnector
    with_path = KVTransferConfig(kv_connector="KVCheckpointConnector", kv_role="kv_both",
                                 kv_connector_module_path="kvci_plugin.connector")
    assert KVConnectorFactory.get_connector_class(with_path) is KVCheckpointConnector


def test_register_imports_no_kvci_module_and_names_lmcache_lazily():
    # It runs in every vLLM process: the connector, torch-heavy kvci layers and LMCache are
    # imported only when vLLM creates a connector by one of these names.
    code = (
        "import sys\n"
        "from kvci_plugin.plugin import register\n"
        "register(); register()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('kvci_plugin.', 'lmcache')))\n"
        "print(loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "['kvci_plugin.plugin']"
