"""Large records are stored packed (zlib) and read back the same, by every reader, from either form.

The reference is the record itself: what `to_json` writes, read back through `from_json` from
the packed bytes, equals the record; `Generations` hands every reader the text it was given,
through `get` and through its watch, from a real etcd.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from typing import Any

import pytest

from elastic.coordinator import Generation, Generations, JobKeys, jsonrecord
from elastic.coordinator.jsonrecord import PACK_MIN_BYTES, RecordError, pack_text, unpack_text
from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan
from elastic.records.generation import GenerationRecord

from .support import wait_for


def _record(nodes: int) -> GenerationRecord:
    spec = ClusterSpec(model="gpt3-6.7b", nodes=nodes, gpus_per_node=8, fault_tolerance=1,
                       global_batch=nodes * 8, microbatch=1, device_memory_gib=80)
    plan = initial_plan(spec, cluster_templates(spec))
    return GenerationRecord(plan=plan, resume_step=3, incarnations={n: n % 3 for n in plan.nodes}, reason="start")


def test_small_text_is_stored_as_it_is_and_large_text_packed() -> None:
    small = json.dumps({"a": "x" * (PACK_MIN_BYTES - 20)})
    assert len(small) < PACK_MIN_BYTES and pack_text(small) == small.encode()
    large = json.dumps({"a": list(range(2000))})
    packed = pack_text(large)
    assert packed[0] == 0x78 and len(packed) < len(large) / 2
    assert unpack_text(packed) == large.encode() and unpack_text(small.encode()) == small.encode()


def test_text_that_packing_would_not_shorten_is_stored_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    noise = json.dumps({"a": random.Random(0).randbytes(200).hex()})  # hex digits: zlib saves a little
    assert unpack_text(pack_text(noise)) == noise.encode() and len(pack_text(noise)) < len(noise)
    monkeypatch.setattr(jsonrecord, "PACK_MIN_BYTES", 1)
    assert pack_text('{"a": 1}') == b'{"a": 1}', "zlib's framing would make it longer"


@pytest.mark.parametrize("nodes", [2, 64, 512])
def test_a_packed_record_reads_as_the_record(nodes: int) -> None:
    record = _record(nodes)
    text = record.to_json()
    packed = record.to_packed()
    assert (packed[0] == 0x78) == (len(text) >= PACK_MIN_BYTES)
    assert GenerationRecord.from_json(packed) == GenerationRecord.from_json(text) == record
    if nodes == 512:
        assert len(packed) * 5 < len(text), f"{len(text)} B packed to {len(packed)} B"


def test_bad_packed_values_are_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = _record(64).to_packed()
    with pytest.raises(RecordError, match="corrupt"):
        GenerationRecord.from_json(packed[:2] + bytes(b ^ 0x55 for b in packed[2:40]) + packed[40:])
    with pytest.raises(RecordError, match="truncated"):
        GenerationRecord.from_json(packed[: len(packed) // 2])
    with pytest.raises(RecordError, match="after its end"):
        GenerationRecord.from_json(packed + b"junk")
    bomb = zlib.compress(b" " * 4096)
    monkeypatch.setattr(jsonrecord, "MAX_UNPACKED_BYTES", 1024)
    with pytest.raises(RecordError, match="more than 1024 bytes"):
        unpack_text(bomb)
    with pytest.raises(RecordError, match="GenerationRecord: a packed record is corrupt"):  # JSON never starts with 0x78
        GenerationRecord.from_json(b"x{}")


@pytest.mark.timeout(60)
def test_generations_store_a_large_plan_packed_and_give_back_its_text(client: Any, job: str) -> None:
    keys = JobKeys(job)
    gens = Generations(client, keys)
    seen: list[Generation] = []
    arrived = threading.Event()

    def on_generation(gen: Generation) -> None:
        seen.append(gen)
        arrived.set()

    watch = gens.watch(on_generation, after=0)
    try:
        texts = [_record(nodes).to_json() for nodes in (2, 256)]
        for i, text in enumerate(texts):
            gens.publish(text, expected=i)
        wait_for(lambda: len(seen) == 2, 20.0, "both generations through the watch")
    finally:
        watch.cancel()
    stored = [client.get(keys.plan(g))[0] for g in (1, 2)]
    assert stored[1][0] == 0x78 and len(stored[1]) * 5 < len(texts[1])
    assert [g.plan for g in seen] == texts == [gens.get(g).plan for g in (1, 2)]  # type: ignore[union-attr]
    assert [GenerationRecord.from_json(v) for v in stored] == [GenerationRecord.from_json(t) for t in texts]
