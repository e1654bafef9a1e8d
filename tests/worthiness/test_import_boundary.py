from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvci_plugin

REPO_ROOT = Path(kvci_plugin.__file__).resolve().parents[1]


def test_the_worthiness_layer_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, kvci_plugin.worthiness; heavy = sorted(m for m in sys.modules if "
        "m.split('.')[0] in {'torch', 'vllm', 'lmcache'}); print(heavy); sys.exit(1 if heavy else "
        "0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
