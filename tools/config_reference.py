"""Render the `kv_connector_extra_config` and `kv_transfer_params.kvci` references from the code.

`python tools/config_reference.py --write` refreshes the blocks in docs/configuration.md between
the `<!-- config:... -->` markers; a test (tests/test_readme_reference.py) fails when that page
and the models disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel

from kvci_plugin.connector.config import CacheGateSettings, KVCIConfig, TimeoutSettings
from kvci_plugin.request.params import KVCIRequestParams

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, Path):
        value = str(value).replace(str(Path.home()), "~")
    return f"`{value!r}`" if value not in (None, [], ()) else "none"


def _plain(tp: Any) -> Any:
    """The type without Annotated constraints (they are enforced, just not shown here)."""
    if get_origin(tp) is Annotated:
        return _plain(get_args(tp)[0])
    if get_origin(tp) is list:
        return list[_plain(get_args(tp)[0])]
    return tp


def _type(field: Any) -> str:
    text = str(_plain(field.annotation)).replace("typing.", "").replace("pydantic.types.", "")
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("pathlib.", "").replace("kvci_plugin.governance.credential_config.", "")
    text = text.replace("kvci_plugin.request.params.", "")
    return text.replace(" | ", " or ").replace("Optional[", "").replace("]]", "]")


def table(model: type[BaseModel], prefix: str = "") -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(f"| `{prefix}{name}` | `{_type(field)}` | {_default(field)} | "
                    f"{field.description or ''} |")
    return "\n".join(rows)


BLOCKS = {
    "config:extra": lambda: (table(KVCIConfig) + "\n\n" + table(CacheGateSettings, "cache_gate.")
                             + "\n\n" + table(TimeoutSettings, "timeouts.")),
    "config:params": lambda: table(KVCIRequestParams),
}


def render(text: str) -> str:
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{REFERENCE.name} lacks the <!-- {name} --> block")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)  # noqa: B023
    return text


if __name__ == "__main__":
    current = REFERENCE.read_text()
    fresh = render(current)
    if "--write" in sys.argv:
        REFERENCE.write_text(fresh)
    elif fresh != current:
        raise SystemExit("docs/configuration.md is stale: run tools/config_reference.py --write")
