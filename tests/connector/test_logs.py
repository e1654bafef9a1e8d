"""kvci's log lines reach vLLM's handlers, at vLLM's level, and still reach the root logger."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from kvci_plugin.logs import log_where_vllm_logs


@pytest.fixture
def vllm_handler():
    """A handler on vLLM's logger, as vLLM's logging configuration installs one."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.INFO)
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    vllm_logger.addHandler(handler)
    # As a fresh process has it: a connector made earlier in this one may have installed ours.
    ours = logging.getLogger("kvci_plugin")
    kept = (list(ours.handlers), ours.level)
    ours.handlers.clear()
    ours.setLevel(logging.NOTSET)
    yield stream
    ours.handlers[:] = kept[0]
    ours.setLevel(kept[1])
    vllm_logger.removeHandler(handler)
    vllm_logger.setLevel(level)


def test_an_info_line_of_kvci_reaches_vllms_handler_and_the_root(vllm_handler, caplog) -> None:
    log_where_vllm_logs()
    log_where_vllm_logs()  # once per process, however often a connector is made
    with caplog.at_level(logging.INFO):
        logging.getLogger("kvci_plugin.connector.anything").info(
            "kvci: control surface on %s", "here"
        )
        logging.getLogger("kvci_plugin.connector.anything").debug("kvci: not at vLLM's level")
    assert vllm_handler.getvalue().count("kvci: control surface on here") == 1
    assert "not at vLLM's level" not in vllm_handler.getvalue()
    assert "kvci: control surface on here" in caplog.text  # the root logger still sees it


def test_a_handler_on_both_vllm_and_the_root_gets_each_record_once(vllm_handler) -> None:
    """As pytest's log capture sits on both: it must not see kvci's records twice."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    both = Collect()
    logging.getLogger("vllm").addHandler(both)
    logging.getLogger().addHandler(both)
    try:
        log_where_vllm_logs()
        logging.getLogger("kvci_plugin.worthiness.anything").warning("kvci: once")
    finally:
        logging.getLogger("vllm").removeHandler(both)
        logging.getLogger().removeHandler(both)
    assert seen.count("kvci: once") == 1
    assert vllm_handler.getvalue().count("kvci: once") == 1


def test_under_vllm_serve_logging_a_kvci_line_is_printed_in_vllms_format() -> None:
    """A fresh process, vLLM's own logging configuration applied, as an engine core has it."""
    code = (
        "import logging\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "from kvci_plugin.logs import log_where_vllm_logs\n"
        "logging.getLogger('kvci_plugin.x').info('kvci: before')\n"
        "log_where_vllm_logs()\n"
        "logging.getLogger('kvci_plugin.x').info('kvci: after')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "kvci: before" not in said  # what kvci's INFO lines did without it
    line = next(line for line in said.splitlines() if "kvci: after" in line)
    assert "INFO" in line
