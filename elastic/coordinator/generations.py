"""Plan generations, written with compare-and-swap transactions.

`generation` holds the latest committed generation number g; `plan/<g>` its plan (opaque JSON,
see templates/plan.py, stored packed: zlib-compressed when large, `jsonrecord.pack_text`; every
`Generation` here carries it unpacked). `publish(plan, expected=g)` writes g+1 and its plan in one transaction
that succeeds only if the generation is still g and plan g+1 does not exist: generations are
strictly increasing, and no generation ever has two plans, whatever the number of concurrent
writers. Passing the leader's `fence` (LeaderElection.leader_compare()) also rejects a deposed
leader. Workers act only on what `watch()` delivers: committed generations, in order.

Committed steps are not here: a step commits on the workers' vote, and the records of it are in
`elastic/records/progress.py` (the `progress` key and the per-pipeline step logs).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from .etcd_api import Compare, EtcdClient
from .jsonrecord import pack_text, unpack_text
from .keys import JobKeys
from .watch import Cancelable, Subscribe, WatchEvent, watch_from_now


class GenerationConflict(RuntimeError):
    """A compare-and-swap lost: someone else moved the generation first."""

    def __init__(self, message: str, *, current: int) -> None:
        super().__init__(message)
        self.current = current


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One committed generation."""

    number: int
    """Generation number, 1 for the first plan."""
    plan: str
    """The plan as JSON text."""
    revision: int
    """etcd revision at which it was committed."""


class Generations:
    """Read, publish and watch the generations of one job."""

    def __init__(self, client: EtcdClient, keys: JobKeys) -> None:
        self.client = client
        self.keys = keys

    def current_number(self) -> int:
        """The latest committed generation number; 0 before the first."""
        value, _ = self.client.get(self.keys.generation)
        return int(value) if value is not None else 0

    def current(self) -> Generation | None:
        """The latest committed generation with its plan (plans never change once written)."""
        number = self.current_number()
        if number == 0:
            return None
        gen = self.get(number)
        assert gen is not None, f"generation {number} has no plan"
        return gen

    def get(self, number: int) -> Generation | None:
        value, meta = self.client.get(self.keys.plan(number))
        if value is None or meta is None:
            return None
        return Generation(number=number, plan=unpack_text(value).decode(), revision=meta.mod_revision)

    def publish(self, plan: str, *, expected: int, fence: Compare | None = None) -> Generation:
        """Commit `plan` as generation expected+1, or raise GenerationConflict."""
        try:
            json.loads(plan)
        except ValueError as exc:
            raise ValueError(f"a plan must be JSON text: {exc}") from exc
        if expected < 0:
            raise ValueError(f"expected generation must be >= 0, got {expected}")
        txn = self.client.transactions
        gen_key, new = self.keys.generation, expected + 1
        compare = [txn.create(self.keys.plan(new)) == 0]
        compare.append(txn.create(gen_key) == 0 if expected == 0 else txn.value(gen_key) == str(expected))
        if fence is not None:
            compare.append(fence)
        ok, responses = self.client.transaction(
            compare=compare,
            success=[txn.put(gen_key, str(new)), txn.put(self.keys.plan(new), pack_text(plan))],
            failure=[],
        )
        if not ok:
            current = self.current_number()
            raise GenerationConflict(
                f"cannot publish generation {new}: current generation is {current}"
                + (" or this writer is no longer the leader" if fence is not None else ""),
                current=current,
            )
        return Generation(number=new, plan=plan, revision=int(responses[0].response_put.header.revision))

    def watch(
        self, on_generation: Callable[[Generation], None], *, after: int | None = None,
        subscribe: Subscribe | None = None,
    ) -> Cancelable:
        """Deliver each committed generation (in order) newer than `after` (default: the current
        one): those already committed first, on the calling thread, then each one published.
        `subscribe` follows the plans' prefix (default: `watch_from_now` on this client)."""
        last = [self.current_number() if after is None else after]

        def handle(events: list[WatchEvent]) -> None:
            for ev in events:
                suffix = ev.key[len(self.keys.plans):]
                if ev.kind != "put" or not suffix.isdigit():
                    continue
                number = int(suffix)
                if number > last[0]:
                    last[0] = number
                    on_generation(Generation(number=number, plan=unpack_text(ev.value).decode(), revision=ev.revision))

        follow = subscribe if subscribe is not None else functools.partial(watch_from_now, self.client)
        return follow(self.keys.plans, handle)
