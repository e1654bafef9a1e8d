"""What the value policy learned about the workload, kept across restarts (``policy_state_file``).

A fresh tier knows nothing of how soon its workload's contexts come back: until its own evidence
builds up it weighs every class by an optimistic prior, and a restart throws an hour of learning
away (``benchmarks.policy_sim``'s ``kvci-restarted``: a tier restarted halfway through the
conversation trace, against one restarted from this file, ``kvci-restarted-warm``). The file
holds only the reuse hazard's counts — per class (score band, re-sends, what the client said of
the turn's end) and idle-age bucket, how
many re-sends and how many seconds of idle time — no key, no context, no tenant: nothing a reader
could learn a prompt from.

Written whole to a temporary file, then renamed over the old one (a crash leaves the old file or
the new, never half of one), owner-only. A file that cannot be read as this version's (other
idle-age buckets or classes, a hand edit, no permission) is reported and learned afresh, and the
next save replaces it: it only ever holds what a tier can learn again, so it never stops an
engine from starting or from stopping.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from kvci_plugin.policy.anchor_table import PolicyClass
from kvci_plugin.policy.offer import COUNT_CAP, SCORE_BANDS, UNSCORED_BAND
from kvci_plugin.policy.reuse_hazard import EDGES, HazardCounts, ReuseHazard

logger = logging.getLogger(__name__)

FORMAT = "kvci-policy-state/1"
# A serving tier writes its learning this often; a crash loses at most this much of it.
SAVE_EVERY_S = 60.0
# Far above any real count (seconds idle summed over every context for years), and low enough
# that no sum of a file's counts overflows.
_MAX_COUNT = 1e15

_Count = Annotated[float, Field(ge=0.0, le=_MAX_COUNT, allow_inf_nan=False)]


class _ClassCounts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    band: int = Field(ge=UNSCORED_BAND, lt=SCORE_BANDS)
    resent: int = Field(ge=0, le=COUNT_CAP)
    # The client's tool_call_pending; a file written before kvci classed by it has every
    # context unsaid, which is what that version saw.
    pending: StrictBool | None = None
    reuses: list[_Count] = Field(min_length=len(EDGES), max_length=len(EDGES))
    exposure_s: list[_Count] = Field(min_length=len(EDGES), max_length=len(EDGES))


class _PolicyState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["kvci-policy-state/1"]
    # The class scheme the counts are kept in: counts of another are not this version's to read.
    edges_s: list[float]
    score_bands: int
    count_cap: int
    classes: list[_ClassCounts]


class PolicyStateFile:
    """One policy state file: ``load`` what a tier learned, ``save`` what this one has."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        folder = self.path.parent
        if not folder.is_dir():
            raise ValueError(f"policy_state_file {self.path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"policy_state_file {self.path}: folder {folder} is not writable")
        if self.path.is_dir():
            raise ValueError(f"policy_state_file {self.path} is a folder")
        # A write cut short by a kill leaves its temporary file: only this file's are ours.
        for stale in folder.glob(f".{self.path.name}.*"):
            stale.unlink(missing_ok=True)

    def load(self) -> ReuseHazard | None:
        """The hazard the file's counts make; None when there is no file yet. Raises
        ``ValueError`` saying why when the file is not one this version wrote, ``OSError``
        when it cannot be read."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = _PolicyState.model_validate_json(raw)
        except ValidationError as exc:
            raise ValueError(
                f"policy_state_file {self.path} is not a kvci policy state: {exc}"
            ) from None
        scheme = (state.edges_s, state.score_bands, state.count_cap)
        if scheme != (list(EDGES), SCORE_BANDS, COUNT_CAP):
            raise ValueError(f"policy_state_file {self.path} counts in other classes or idle-age "
                             f"buckets than this version's")
        reuses: dict[PolicyClass, tuple[float, ...]] = {}
        exposure: dict[PolicyClass, tuple[float, ...]] = {}
        for row in state.classes:
            cls = (row.band, row.resent, row.pending)
            if cls in reuses:
                raise ValueError(f"policy_state_file {self.path}: class {cls} twice")
            reuses[cls], exposure[cls] = tuple(row.reuses), tuple(row.exposure_s)
        return ReuseHazard.from_counts(HazardCounts(reuses=reuses, exposure=exposure))

    def restore(self) -> ReuseHazard | None:
        """``load``, but a file it cannot read is reported and learned afresh (the next save
        replaces it): a tier must not refuse to start over what it can learn again."""
        try:
            return self.load()
        except ValueError as exc:
            logger.warning("kvci: %s; learning the workload afresh", exc)
            return None
        except OSError as exc:
            logger.warning(
                "kvci: policy_state_file %s cannot be read (%s); learning the workload afresh",
                self.path,
                exc,
            )
            return None

    def save(self, counts: HazardCounts) -> None:
        counts = counts.closed()
        zero = (0.0,) * len(EDGES)
        rows = []
        for cls in sorted(set(counts.reuses) | set(counts.exposure), key=repr):
            if not (
                isinstance(cls, tuple)
                and len(cls) == 3
                and all(isinstance(v, int) for v in cls[:2])
                and cls[2] in (None, True, False)
            ):
                raise TypeError(f"a policy state class is (band, resent, pending), not {cls!r}")
            rows.append(_ClassCounts(band=cls[0], resent=cls[1], pending=cls[2],
                                     reuses=list(counts.reuses.get(cls, zero)),
                                     exposure_s=list(counts.exposure.get(cls, zero))))
        state = _PolicyState(format=FORMAT, edges_s=list(EDGES), score_bands=SCORE_BANDS,
                             count_cap=COUNT_CAP, classes=rows)
        # mkstemp makes the file owner-only (0600), and the rename keeps that.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(state.model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        # The rename itself outlives a power cut only once the folder is synced.
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


class PolicyStateSaver:
    """Saves ``learned()`` to ``file`` every ``every_s`` seconds of ``clock`` and when asked.

    ``learned`` runs on the caller's thread and only copies the counts (it reads the policy
    under the index's lock); counting the open idle periods, the write and its fsync run on a
    thread of their own. The save at shutdown waits for a write in flight, then writes. A failed
    save is reported, never raised: the engine serves, and stops, without it."""

    def __init__(
        self,
        file: PolicyStateFile,
        learned: Callable[[], HazardCounts | None],
        *,
        every_s: float = SAVE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(every_s) and every_s > 0):
            raise ValueError(f"every_s must be > 0, not {every_s!r}")
        self.file = file
        self._learned = learned
        self._every_s = every_s
        self._clock = clock
        self._last = clock()
        self._writing: threading.Thread | None = None
        self.saves = 0

    def tick(self) -> None:
        """Start a save when one is due and none is in flight (a failed one is tried again when
        next due)."""
        if self._clock() - self._last < self._every_s or (
            self._writing and self._writing.is_alive()
        ):
            return
        self._last = self._clock()
        counts = self._learned()
        if counts is not None:
            self._writing = threading.Thread(
                target=self._write, args=(counts,), name="kvci-policy-state", daemon=True
            )
            self._writing.start()

    def save(self) -> None:
        """Save now, on this thread (at shutdown)."""
        if self._writing is not None:
            self._writing.join()
        self._last = self._clock()
        counts = self._learned()
        if counts is not None:
            self._write(counts)

    def _write(self, counts: HazardCounts) -> None:
        try:
            self.file.save(counts)
        except Exception as exc:  # noqa: BLE001 - reported: the state is a cache of what is learned again
            logger.warning("kvci: could not save the policy state to %s: %s", self.file.path, exc)
        else:
            self.saves += 1
