"""A request's turn through the real scheduler side, with no engine: what vLLM hands the
connector's scheduler hooks (the blocks it allocated, a step's scheduled tokens, the workers'
report), and one turn from lookup to the workers' copy."""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request, RequestStatus

from kvci_plugin.connector.scheduler import KVCIScheduler


class Blocks:
    """What vLLM hands update_state_after_alloc: each KV cache group's block ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class Output:
    """The workers' report on a step: these requests' store copies are done."""

    def __init__(self, finished_sending: set[str]) -> None:
        self.finished_sending = finished_sending
        self.finished_recving: set[str] = set()
        self.kv_connector_worker_meta = None


class Step:
    """A scheduler step: the tokens scheduled per request."""

    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = sum(scheduled.values())


def run_turn(s: KVCIScheduler, req: Request,
             output: list[int]) -> tuple[int, dict[str, Any] | None]:
    """``req`` looked up (its hit loaded), run and finished with ``output``, its store copied:
    its hit tokens and its reply's kvci."""
    hit, _ = s.get_num_new_matched_tokens(req, 0)
    if hit:
        s.update_state_after_alloc(req, Blocks([20, 21, 22, 23]), hit)
    s.build_connector_meta(Step({req.request_id: len(req.prompt_token_ids) - hit}))
    req.num_computed_tokens = len(req.prompt_token_ids)
    req.append_output_token_ids(output)
    req.status = RequestStatus.FINISHED_STOPPED
    held, reply = s.request_finished(req, [[10, 11, 12, 13]])
    if held:  # the workers copied its pages: loadable from now on
        s.update_connector_output(Output({req.request_id}))
    return hit, None if reply is None else reply["kvci"]
