"""The package stays readable (#48): no module of kvci_plugin over 600 lines, and the connector's
scheduler side a file of hooks that hand their work to parts (at most 350 lines, no function over
50)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvci_plugin"
SCHEDULER = PACKAGE / "connector" / "scheduler.py"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_600_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 600


def test_the_scheduler_side_hands_its_work_to_parts() -> None:
    source = SCHEDULER.read_text()
    assert len(source.splitlines()) <= 350
    long = {node.name: node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > 50}
    assert long == {}
