"""An agent started by a local launcher stops its node when that launcher ends.

The launcher passes its pid in $ELASTIC_LAUNCHER_PID (elastic/roles/agent_pool.py). The agent
watches it with a pidfd (`WorkerMonitor`), so a SIGKILLed launcher is seen at once. Its workers
are then killed and the agent exits failed, as on its SIGINT. The agent's parent is no help here:
an agent forked from a shared warm parent (a test session's, $ELASTIC_ZYGOTE) is not the
launcher's child. One such agent outlived a launcher killed at a test's timeout, and its workers
spun on their dead peers' sockets until the agent gave up on etcd, 5 minutes later, starving
every test after it. Agents started by other means (torchrun, SLURM, Kubernetes) get no pid and
watch nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elastic.coordinator.client import stop_retrying
from elastic.coordinator.monitor import WorkerMonitor

if TYPE_CHECKING:
    from elastic.roles.agent import Agent

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "ELASTIC_LAUNCHER_PID"
"""The pid of the launcher that started the agent (unset: the agent watches nothing)."""


def watch_launcher(agent: Agent, pid: str | None) -> WorkerMonitor | None:
    """Stop `agent`'s node once process `pid` has ended (module doc); None when `pid` is unset."""
    if not pid:
        return None

    def gone(_pid: int) -> None:
        log.warning("%s (incarnation %d): the launcher (pid %s) is gone; stopping the node", agent.who,
                    agent.incarnation, pid)
        stop_retrying(agent.client)
        agent.kill_workers()
        agent.finish_failed()

    return WorkerMonitor([int(pid)], gone)
