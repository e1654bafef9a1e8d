"""`kv_connector_extra_config`, validated: every key kvci reads, its default and its meaning.

The README's configuration reference is this model. Unknown keys are an error (a typo must not
silently fall back to a default), and nothing here can widen what is persisted: the disk tier is
only ever reached through the eligibility gate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from kvci_plugin.api.access import check_bind, host_name, origin
from kvci_plugin.connector.dependency_urls import check_no_password, with_password
from kvci_plugin.governance import CredentialConfig
from kvci_plugin.policy.admission import DEFAULT_MIN_THRESHOLD, DEFAULT_STEP
from kvci_plugin.tiering.blobs.tenant_keys import KeyFileRootKey, RootKeyProvider, StateDirRootKey
from kvci_plugin.tiering.secret import DEFAULT_STATE_DIR
from kvci_plugin.tiering.timeouts import DependencyTimeouts
from kvci_plugin.worthiness import DEFAULT_RAM_THRESHOLD


class CacheGateSettings(BaseModel):
    """The autonomous-trigger cache gate: when the system trigger pauses its stores."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kill_switch: bool = Field(False, description="pause every autonomous store")
    hit_rate_floor: float | None = Field(
        None, ge=0.0, le=1.0, description="pause autonomous stores while the hit rate is below; "
        "none = 0.30 under ram_policy `threshold`, off under `value` and `lru` (a local copy per "
        "write, and `value` weighs each one)")
    hit_rate_window: int = Field(200, ge=1, description="lookups in the rolling hit-rate window")
    min_lookups: int = Field(20, ge=1, description="lookups before the floor may judge")
    churn_window_s: float = Field(300.0, gt=0.0, description="window for context rewrites")
    churn_threshold: int = Field(3, ge=1, description="rewrites in the window that pause a session")


_TIMEOUTS = DependencyTimeouts()


class TimeoutSettings(BaseModel):
    """How long the disk tier waits on its catalog and blob store, in seconds: a dependency that
    does not answer in time costs a miss or a dropped write, never a stalled engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect_s: float = Field(
        _TIMEOUTS.connect_s, gt=0.0, allow_inf_nan=False,
        description="opening a connection to the PostgreSQL catalog (rounded up to whole "
        f"seconds, at least 2) or the Redis blob store; default {_TIMEOUTS.connect_s}")
    statement_s: float = Field(
        _TIMEOUTS.statement_s, gt=0.0, allow_inf_nan=False,
        description="one statement of the PostgreSQL catalog (its statement_timeout); "
        "statement_s + lock_s is the longest the engine's step waits for any one call to the "
        "disk tier (a frozen server included), after which the tier is skipped until it answers; "
        f"default {_TIMEOUTS.statement_s}")
    lock_s: float = Field(
        _TIMEOUTS.lock_s, gt=0.0, allow_inf_nan=False,
        description="a wait for a lock in the PostgreSQL catalog (its lock_timeout), the lock "
        f"that serializes every node's catalog writes included; default {_TIMEOUTS.lock_s}")
    blob_s: float = Field(
        _TIMEOUTS.blob_s, gt=0.0, allow_inf_nan=False,
        description="one request to the Redis blob store, and the embedded SQLite catalog's "
        f"wait for its file's lock; default {_TIMEOUTS.blob_s}")


# The worthiness bar's settings: they choose ram_policy "threshold" unless it is named.
_BAR_SETTINGS = ("ram_threshold", "ram_admission", "ram_threshold_min")


class KVCIConfig(BaseModel):
    """kvci's part of `--kv-transfer-config`, under `kv_connector_extra_config`."""

    # A refused value is not echoed: it may be a URL, a path or a credential.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    ram_bytes: ByteSize = Field(ByteSize(1 << 30), description="host-RAM tier size")
    ram_max_entries: int = Field(4096, ge=1, description="most checkpoints kept in RAM")
    tenant_quota_bytes: ByteSize | None = Field(None, description="RAM bytes one tenant may hold")
    max_retain_s: float = Field(
        300.0, ge=0.0, allow_inf_nan=False,
        description="longest `kvci.retain.ttl_s` a request may ask for; 0 = no retention")
    tool_call_markers: list[str] | None = Field(
        None, description="the model's tool-call marker tokens (each one token of its tokenizer); "
        "None: found from the tokenizer's vocabulary and chat template for the common families; "
        "[]: detection off. A turn whose output holds one is retained through the tool's pause "
        "(learned TTL, at most `max_retain_s`)")
    system_trigger: bool = Field(True, description="store worthy contexts without being asked")
    ram_policy: Literal["value", "lru", "threshold"] = Field(
        "value",
        description="what the RAM tier keeps: `value` offers every request the worthiness rules do "
        "not block (`checkpoint: never`, a veto, no evidence, the model's self-report alone) "
        "and keeps, under pressure, only what is worth more than what it would evict "
        "(kvci_plugin.policy.ValuePolicy); `lru` keeps every such request and evicts the least "
        "recently used (vLLM's native offloading); `threshold` keeps what clears the worthiness "
        "bar (ram_threshold, ram_admission), LRU eviction. `threshold` when ram_threshold or "
        "ram_admission or ram_threshold_min is set and this is not. Explicit checkpoints are kept "
        "whatever the policy and evicted last",
    )
    policy_state_file: Path | None = Field(
        None, description="where ram_policy `value` keeps what it learned about the workload "
        "(how soon contexts of each class come back: counts only, no context, no tenant) across "
        "restarts: read at start, written every minute of serving and when the engine shuts "
        "down gracefully (vLLM's --shutdown-timeout above 0; at 0 the engine is killed at once "
        "and the last periodic save stands); with data parallelism each rank keeps its own "
        "(`name.dpN.ext`); none = learned afresh at each start")
    ram_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description=f"score for tier RAM; none = {DEFAULT_RAM_THRESHOLD}. "
        "Setting it fixes the system trigger's bar there unless ram_admission is set to `pressure`")
    disk_threshold: float | None = Field(None, ge=0.0, le=1.0, description="score for tier DISK")
    ram_admission: Literal["pressure", "fixed"] = Field(
        "pressure",
        description="the system trigger's RAM bar: `pressure` starts at ram_threshold and moves "
        f"{DEFAULT_STEP} up for each system checkpoint evicted before any hit (at most to the disk "
        f"threshold) and {DEFAULT_STEP} down for each request that wanted one the bar alone held "
        "back (at least to ram_threshold_min); `fixed` stays at ram_threshold. `fixed` when "
        "ram_threshold is set and this is not. Explicit checkpoints are kept whatever the bar",
    )
    ram_threshold_min: float = Field(
        DEFAULT_MIN_THRESHOLD, gt=0.0, le=1.0,
        description="lowest RAM bar with ram_admission `pressure`")
    cache_gate: CacheGateSettings = CacheGateSettings()
    window_stages: bool = Field(
        True, description="sliding-window models (vLLM's hybrid KV cache manager): copy a "
        "sliding-window group's window during prefill at each block boundary a later hit may "
        "start from (the prompt's exact repeat, its last full block, the ladder, the junction a "
        "hybrid lookup found), so that a repeat, a continuation or a request sharing part of the "
        "prompt hits after the window has moved on; the copies are kept only with the request's "
        "checkpoint. Off: only the end window is kept")
    window_ladder_from: int = Field(
        1, ge=0, description="the ladder of window boundaries for shared prefixes: power-of-two "
        "block counts from this many tokens (and at least four windows) up to the prompt's end, "
        "so a request sharing P blocks of a prompt hits more than P/2 of them; 0 = no ladder")
    window_interval: int = Field(
        0, ge=0, description="also a window boundary every this many tokens of the prompt (a "
        "multiple of the block size is exact); 0 = none")
    window_stage_bytes: ByteSize | None = Field(
        None, description="most RAM the windows of requests still running may take (they never "
        "evict: a window that does not fit is skipped and counted); none = ram_bytes / 8")
    disk_root: Path | None = Field(
        None, description="disk tier folder, local or shared by nodes; none = no disk tier "
        "(unless blob_url is set)")
    disk_bytes: ByteSize = Field(
        ByteSize(16 << 30), description="disk tier bound (across every node sharing a catalog)")
    catalog_url: str | None = Field(
        None, pattern=r"^postgres(ql)?://",
        description="PostgreSQL catalog shared by nodes; none = SQLite in disk_root (one node)")
    blob_url: str | None = Field(
        None, pattern=r"^(redis|rediss|unix)://",
        description="Redis/Valkey blob store shared by nodes; none = blobs in disk_root")
    catalog_password_file: Path | None = Field(
        None, description="file (owner-only) holding catalog_url's password; a password in the "
        "URL itself is refused. none = libpq's own (PGPASSFILE, PGPASSWORD) or no password")
    blob_password_file: Path | None = Field(
        None, description="file (owner-only) holding blob_url's password; a password in the URL "
        "itself is refused")
    lease_s: float = Field(
        600.0, gt=0.0, description="how long a write holds its pages against other nodes' "
        "deletions; an orphan blob younger than this is kept")
    timeouts: TimeoutSettings = Field(
        TimeoutSettings(), description="how long the disk tier waits on its catalog and blob "
        "store (`timeouts.connect_s`, `statement_s`, `lock_s`, `blob_s`, in seconds)")
    disk_region: str | None = Field(None, description="residency region of disk_root")
    auto_promote: bool = Field(
        False, description="system trigger may ask the gate to persist when DiskPromotionRule holds"
    )
    credentials: CredentialConfig | None = Field(
        None, description="credential verification; none = no verified authority, nothing persists"
    )
    revocation_db: Path | None = Field(None, description="SQLite revocation list")
    label_catalog: Path | None = Field(None, description="SQLite source-label catalog")
    label_catalog_json: Path | None = Field(None, description="JSON labels imported at start")
    state_dir: Path = Field(
        DEFAULT_STATE_DIR,
        description="holds `secret`, the prefix-key secret and (without key_file) the root key "
        "that seals disk blobs (created 0600 on first use; copy it to every node that must share "
        "keys)",
    )
    key_file: Path | None = Field(
        None, description="root key that seals disk blobs (0600, >= 16 bytes, e.g. written by a "
        "KMS agent; the same on every node sharing the disk tier); none = state_dir's secret")
    tenancy: Literal["declared", "verified"] = Field(
        "declared", description="`declared`: a request's tenant is the one it declares (as "
        "trustworthy as the gateway in front of vLLM); `verified`: only a verified session "
        "credential sets it, and a request without one is served with no kvci tier (its reply "
        "says why)")
    model_revision: str | None = Field(None, description="overrides the derived model revision")
    max_params_bytes: int = Field(
        65536, ge=1024, description="size limit of a request's kvci params"
    )
    control_host: str = Field(
        "127.0.0.1", description="REST control surface address: loopback, or any other with TLS")
    control_port: int | None = Field(None, ge=0, le=65535, description="none = no REST surface")
    control_token_file: Path | None = Field(
        None, description="the operator's bearer token file (every action: reset, every tenant's "
        "stats and checkpoints); none = `<state_dir>/control-operator.token`, generated (0600) at "
        "the first start and printed once")
    control_tenant_token_file: Path | None = Field(
        None, description="the tenants' bearer token file: a tenant's own actions, in the tenant "
        "its verified session credential names (tenancy `declared`: the one it declares); none = "
        "`<state_dir>/control-tenant.token`, generated like the operator's")
    control_tls_cert_file: Path | None = Field(
        None, description="TLS certificate chain (PEM) of the control surface; with "
        "control_tls_key_file, required when control_host is not loopback")
    control_tls_key_file: Path | None = Field(
        None, description="private key (PEM) of control_tls_cert_file, not readable by others")
    control_allowed_hosts: tuple[str, ...] = Field(
        (), description="Host header names the control surface answers besides loopback names and "
        "control_host (any other is refused 403: DNS rebinding)")
    control_allowed_origins: tuple[str, ...] = Field(
        (), description="browser Origins (scheme://host[:port]) allowed to call the control "
        "surface; a request carrying any other Origin header is refused 403; none by default")

    @model_validator(mode="before")
    @classmethod
    def _fixed_bar_for_a_chosen_threshold(cls, data: Any) -> Any:
        # An operator who chose a bar gets it; one who chose ram_threshold gets that bar unless
        # they ask for it to move.
        if not isinstance(data, dict):
            return data
        if "ram_policy" not in data and any(data.get(k) is not None for k in _BAR_SETTINGS):
            data = {**data, "ram_policy": "threshold"}
        if data.get("ram_threshold") is not None and "ram_admission" not in data:
            data = {**data, "ram_admission": "fixed"}
        return data

    @model_validator(mode="after")
    def _check(self) -> KVCIConfig:
        bar = {
            k for k in _BAR_SETTINGS if k in self.model_fields_set and getattr(self, k) is not None
        }
        if self.ram_policy != "threshold" and bar:
            raise ValueError(f"{', '.join(sorted(bar))} set the worthiness bar, which applies only "
                             f"with ram_policy 'threshold' (ram_policy is {self.ram_policy!r})")
        if self.policy_state_file is not None and self.ram_policy != "value":
            chosen = (
                " (ram_threshold, ram_admission and ram_threshold_min choose it)"
                if self.ram_policy == "threshold" and self.model_fields_set & set(_BAR_SETTINGS)
                else ""
            )
            raise ValueError(f"policy_state_file keeps what ram_policy 'value' learns; ram_policy "
                             f"{self.ram_policy!r}{chosen} learns nothing")
        if self.ram_admission == "pressure":
            start = DEFAULT_RAM_THRESHOLD if self.ram_threshold is None else self.ram_threshold
            if self.ram_threshold_min > start:
                raise ValueError(f"ram_threshold_min ({self.ram_threshold_min}) is above the RAM "
                                 f"threshold the bar starts at ({start})")
        elif "ram_threshold_min" in self.model_fields_set:
            raise ValueError("ram_threshold_min applies only with ram_admission 'pressure'")
        check_no_password("catalog_url", self.catalog_url)
        check_no_password("blob_url", self.blob_url)
        for url, file in (("catalog_url", self.catalog_password_file),
                          ("blob_url", self.blob_password_file)):
            if file is not None and getattr(self, url) is None:
                raise ValueError(f"{url.replace('_url', '_password_file')} needs {url}")
        if self.blob_url is not None and self.catalog_url is None:
            # Other nodes can reach a Redis store: only a shared catalog's leases keep their
            # writes safe from this node's reconciliation.
            raise ValueError("blob_url needs catalog_url (a shared blob store needs a shared "
                             "catalog)")
        if self.catalog_url is not None and not self.disk_tier:
            raise ValueError("catalog_url needs disk_root or blob_url (where the blobs go)")
        if self.tenancy == "verified" and self.credentials is None:
            raise ValueError("tenancy 'verified' needs credentials (it verifies session "
                             "credentials)")
        if self.auto_promote and not self.disk_tier:
            raise ValueError("auto_promote needs disk_root or blob_url")
        if self.window_stage_bytes is not None and self.window_stage_bytes > self.ram_bytes:
            raise ValueError(f"window_stage_bytes ({int(self.window_stage_bytes)}) is above "
                             f"ram_bytes ({int(self.ram_bytes)})")
        self._check_control()
        return self

    def catalog_dsn(self) -> str | None:
        """catalog_url with its password (from catalog_password_file), for connecting only."""
        if self.catalog_url is None:
            return None
        return with_password(self.catalog_url, self.catalog_password_file)

    def blob_dsn(self) -> str | None:
        """blob_url with its password (from blob_password_file), for connecting only."""
        if self.blob_url is None:
            return None
        return with_password(self.blob_url, self.blob_password_file)

    def _check_control(self) -> None:
        if (self.control_tls_cert_file is None) != (self.control_tls_key_file is None):
            raise ValueError("control_tls_cert_file and control_tls_key_file go together")
        if self.control_port is not None:
            check_bind(self.control_host, self.control_tls_cert_file is not None)
        for name in self.control_allowed_hosts:
            host_name(name)
        for value in self.control_allowed_origins:
            origin(value)

    def for_data_parallel_rank(self, rank: int, size: int) -> KVCIConfig:
        """One data-parallel rank's settings: every rank is given the same extra config, and each
        keeps its own policy state file (``name.dp<rank>.ext``) when there are several."""
        path = self.policy_state_file
        if size <= 1 or path is None:
            return self
        return self.model_copy(
            update={"policy_state_file": path.with_name(f"{path.stem}.dp{rank}{path.suffix}")}
        )

    def dependency_timeouts(self) -> DependencyTimeouts:
        """The disk tier's bounded waits, as the tier takes them."""
        return DependencyTimeouts(**self.timeouts.model_dump())

    @property
    def root_key(self) -> RootKeyProvider:
        """Where the root key that seals disk blobs comes from."""
        return KeyFileRootKey(self.key_file) if self.key_file else StateDirRootKey(self.state_dir)

    @property
    def disk_tier(self) -> bool:
        """Whether a disk tier is configured."""
        return self.disk_root is not None or self.blob_url is not None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> KVCIConfig:
        """Validate vLLM's extra config; errors name the offending key."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid kvci kv_connector_extra_config: {exc}") from None
