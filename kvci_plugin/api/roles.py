"""Who calls the control surface, and which actions each caller is offered.

- `operator` (the operator token): every action; `reset`, `ram_stats` of every tenant and
  `explain` of any checkpoint are the operator's alone.
- `tenant` (the tenant token): a tenant's own actions, in the tenant its verified session
  credential names (with `tenancy: "declared"`, the tenant it declares, as the gateway in front
  of vLLM vouches for it): `explain` and `ram_stats` show that tenant's checkpoints and bytes only;
  `promote` and `forget` are gated on its credential as always.
- the agent: the MCP tool `graph_kv_checkpoint` offers only `AGENT_ACTIONS`, whatever token the
  MCP server holds: no reset, no other tenant's stats, no promote or forget (a prompt injection
  cannot wipe the fleet's cache or erase a tenant).
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    OPERATOR = "operator"
    TENANT = "tenant"


OPERATOR_ACTIONS = frozenset({"reset"})
AGENT_ACTIONS = ("recommend", "checkpoint_now", "explain", "advisory")
