"""vLLM 0.34's ``may_load_async(request)``: may this request's kvci hit be an asynchronous load?

With ``--max-num-inflight-kv-loads``, vLLM 0.34 keeps the requests whose connector says yes in a
queue of their own, and starts their loads even while the running batch is full. It asks when a
request enters the waiting queues (on arrival, after ``on_new_request``, and again after a
preemption), so the answer must be cheap, and a false positive costs other requests: one that
turns out to load synchronously, or not at all, waits at the head of that queue and holds the
asynchronous loads behind it back until a running slot frees.

kvci's asynchronous loads are its disk loads (a RAM hit is copied beside the step's forward, in
the step that schedules it). So the answer is yes exactly when a disk hit is still possible:

1. the disk tier is attached and healthy (a degraded tier is skipped by the lookup) and not
   suspended by a reset that could not fence it;
2. vLLM lets the request read external KV (0.34's ``skip_reading_external_kv``, 0.32/0.33's
   ``skip_reading_prefix_cache``: vLLM drops a connector hit of such a request);
3. kvci can key it (token ids, no prompt embeddings, no multimodal features), its ``kvci``
   parameters are valid, and it has a full block a hit may cover (never its last token);
4. the RAM tier does not already hold all of that (then the hit is RAM's: synchronous).

What it does not ask is the disk catalog (a database round trip per arrival): a request whose
prefix is on no tier at all is the false positive this leaves, bounded by the disk tier being on.
Keys are computed here once (the native prefix keys, cached in the request's state), so the
lookup that follows pays nothing more. A failure answers no (a false negative only queues the
request with the others).
"""

from __future__ import annotations

from typing import Any

from kvci_plugin.connector.lookups import Lookups
from kvci_plugin.connector.request_state import RequestStates


def may_load_async(lookups: Lookups, request: Any) -> bool:
    """Whether ``request``'s kvci hit may be an asynchronous (disk) load; see the module. The
    caller contains a failure (`KVCIScheduler.may_load_async` answers no)."""
    if not lookups.disk_answers:
        return False
    if getattr(request, "skip_reading_external_kv", False) or getattr(
            request, "skip_reading_prefix_cache", False):
        return False
    cap = (request.num_tokens - 1) // lookups.block_size  # a hit leaves one token to compute
    if cap < 1 or not RequestStates.keyable(request):
        return False
    st = lookups.requests.state(request)
    if not st.keys or st.generation != lookups.requests.generation:
        return False
    return lookups.ram_run(st, cap) < cap
