"""kvci's log lines go where vLLM's go.

vLLM configures only its own ``vllm`` logger (its handler, format and level: ``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_CONFIG_PATH``). kvci's modules log as ``kvci_plugin.*``, below a root logger that
``vllm serve`` leaves without a handler, so their INFO lines — the connector's start line, the
disk tier, the control surface's address, a cache reset, the policy state — went nowhere, and a
warning came out unformatted. A handler on ``kvci_plugin`` hands each record to the handlers
``vllm`` has when the record is made (so a later reconfiguration by vLLM is followed), at
vLLM's level. Records still reach the root logger, so an application that configured its own
logging sees them as before, and a handler on both loggers sees each once; with
``VLLM_CONFIGURE_LOGGING=0`` nothing changes.
"""

from __future__ import annotations

import logging

KVCI_LOGGER = "kvci_plugin"


class _ToVLLMHandlers(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        # A handler on the root logger too (a test's log capture is on both) gets the record
        # there: it is not handed it twice.
        through_root = logging.getLogger().handlers
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level and handler not in through_root:
                handler.handle(record)


def log_where_vllm_logs() -> None:
    """Send kvci's log records to vLLM's handlers, once per process; nothing when vLLM has none
    (its logging is off or not yet configured)."""
    vllm_logger = logging.getLogger("vllm")
    ours = logging.getLogger(KVCI_LOGGER)
    if not vllm_logger.handlers or any(isinstance(h, _ToVLLMHandlers) for h in ours.handlers):
        return
    ours.addHandler(_ToVLLMHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())
