"""What crosses from the scheduler to the workers (and back) each step, as vLLM's classes.

The jobs and the report themselves live in `jobs.py`, free of vllm.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvci_plugin.connector.jobs import StepJobs, WorkerReport


@dataclass
class KVCIMetadata(StepJobs, KVConnectorMetadata):
    pass


@dataclass
class KVCIWorkerMetadata(WorkerReport, KVConnectorWorkerMetadata):
    @classmethod
    def of(cls, report: WorkerReport) -> KVCIWorkerMetadata:
        return cls(**{f.name: getattr(report, f.name) for f in fields(WorkerReport)})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVCIWorkerMetadata:
        assert isinstance(other, KVCIWorkerMetadata)
        return KVCIWorkerMetadata.of(self.merged(other))
