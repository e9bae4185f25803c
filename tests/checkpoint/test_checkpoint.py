"""One writer in this process: round trip, completeness, errors, pruning, copy semantics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from elastic.engine.checkpoint.files import CheckpointError, list_steps, marker_path, read_marker, step_dir
from elastic.engine.checkpoint.load import latest_complete, load_shards
from elastic.engine.checkpoint.writers import CheckpointWriter
from tests.checkpoint.shards import assert_shards_equal, make_shards

LAYERS, TP = 3, 2
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ALL = [(layer, t) for layer in range(LAYERS) for t in range(TP)]


def writer(d: Path, **kw: float) -> CheckpointWriter:
    return CheckpointWriter(d, num_layers=LAYERS, tp_degree=TP, **kw)


@pytest.mark.timeout(60)
def test_round_trip_is_bit_exact_and_needs_every_shard(tmp_path: Path) -> None:
    w = writer(tmp_path)
    first, rest = ALL[:4], ALL[4:]
    w.save_async(5, make_shards(first, step=5))
    w.flush()
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) is None
    # the committed shards already load, bit for bit
    assert_shards_equal(load_shards(tmp_path, 5, first), make_shards(first, step=5))
    w.save_async(5, make_shards(rest, step=5))
    w.close()
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 5
    got = load_shards(tmp_path, 5, ALL)
    assert_shards_equal(got, make_shards(ALL, step=5))
    assert got[(0, 0)]["step"].shape == () and got[(0, 0)]["step"].dtype == torch.int64
    # a model with one more layer is not complete at that step
    assert latest_complete(tmp_path, num_layers=LAYERS + 1, tp_degree=TP) is None


@pytest.mark.timeout(60)
def test_training_may_change_tensors_right_after_save_async(tmp_path: Path) -> None:
    w = writer(tmp_path)
    live = make_shards(ALL, step=3, numel=1 << 16)
    w.save_async(3, live)
    for tensors in live.values():  # the optimizer updates in place while the write goes on
        for t in tensors.values():
            t.zero_()
    w.close()
    assert_shards_equal(load_shards(tmp_path, 3, ALL), make_shards(ALL, step=3, numel=1 << 16))


@pytest.mark.timeout(60)
def test_clear_errors_for_missing_step_and_shard(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.save_async(2, make_shards(ALL[:-1], step=2))
    w.close()
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .*steps present: \[2\]"):
        load_shards(tmp_path, 7, ALL)
    with pytest.raises(CheckpointError, match=r"step 2 .* lacks committed shards \(layer 2, tp 1\)"):
        load_shards(tmp_path, 2, ALL)
    with pytest.raises(CheckpointError, match="no checkpoint of step 0 .*none"):
        load_shards(tmp_path / "nowhere", 0, ALL)


@pytest.mark.timeout(60)
def test_bad_input_is_refused_on_the_calling_thread(tmp_path: Path) -> None:
    w = writer(tmp_path)
    with pytest.raises(ValueError, match=r"layer 3, tp 0\) outside the model's 3 layers x 2"):
        w.save_async(1, {(3, 0): {"step": torch.tensor(1)}})
    with pytest.raises(ValueError, match="'step' is a int, not a tensor"):
        w.save_async(1, {(0, 0): {"step": 1}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="step must be >= 0"):
        w.save_async(-1, make_shards(ALL, step=1))
    with pytest.raises(ValueError, match="num_layers and tp_degree must be >= 1"):
        CheckpointWriter(tmp_path, num_layers=0, tp_degree=1)
    w.close()
    assert list_steps(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_failed_background_write_surfaces_on_flush(tmp_path: Path) -> None:
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the checkpoint directory should be")
    w = writer(blocker)
    w.save_async(1, make_shards(ALL, step=1))
    with pytest.raises(CheckpointError, match="background checkpoint write .* failed"):
        w.flush()
    w.close()  # the error was reported once; the writer still shuts down cleanly


@pytest.mark.timeout(60)
def test_keeps_the_last_two_complete_steps_and_drops_older_partial_ones(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.save_async(1, make_shards(ALL, step=1))
    w.save_async(2, make_shards(ALL[:2], step=2))  # never completed
    for s in (3, 4, 5):
        w.save_async(s, make_shards(ALL, step=s))
    w.save_async(6, make_shards(ALL[:1], step=6))  # partial, newer than the kept ones: stays
    w.close()
    assert list_steps(tmp_path) == [4, 5, 6]
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 5
    assert_shards_equal(load_shards(tmp_path, 4, ALL), make_shards(ALL, step=4))
    assert not any(p.name.startswith(".trash") for p in tmp_path.iterdir())


@pytest.mark.timeout(60)
def test_rewriting_a_shard_replaces_it_and_drops_the_old_data(tmp_path: Path) -> None:
    w = writer(tmp_path)
    w.save_async(4, make_shards([(1, 1)], step=99))
    w.flush()
    old = read_marker(tmp_path, 4, (1, 1))
    assert old is not None
    w.save_async(4, make_shards([(1, 1)], step=4))
    w.close()
    new = read_marker(tmp_path, 4, (1, 1))
    assert new is not None and new.data != old.data
    assert not (step_dir(tmp_path, 4) / old.data).exists()
    assert marker_path(tmp_path, 4, (1, 1)).is_file()
    assert_shards_equal(load_shards(tmp_path, 4, [(1, 1)]), make_shards([(1, 1)], step=4))


@pytest.mark.timeout(120)
def test_training_thread_pays_only_the_copy(tmp_path: Path) -> None:
    """Prints the cost of save_async (the copy) against the background write; no speed assert."""
    numel = 1 << 21  # ~ 8 MiB of fp32 per weight tensor, 6 shards: ~ 120 MiB in all
    live = make_shards(ALL, step=1, numel=numel)
    w = writer(tmp_path)
    t0 = time.perf_counter()
    w.save_async(1, live)
    returned = time.perf_counter() - t0
    w.flush()
    total = time.perf_counter() - t0
    w.close()
    rec = w.records[-1]
    mib = rec.bytes / 2**20
    print(
        f"\ncheckpoint of {mib:.0f} MiB in {rec.shards} shards: save_async returned after "
        f"{returned * 1e3:.1f} ms (copy {rec.copy_s * 1e3:.1f} ms); background write "
        f"{rec.write_s * 1e3:.1f} ms; save to durable {total * 1e3:.1f} ms; "
        f"training-path share {returned / total:.2f}"
    )
    assert rec.bytes == sum(t.numel() * t.element_size() for s in live.values() for t in s.values())
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == 1


@pytest.mark.timeout(60)
def test_a_full_disk_fails_the_save_without_a_marker_reports_it_once_and_the_next_save_works(
    tmp_path: Path,
) -> None:
    import os

    from tests.tmpfs import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "tmpfs", size="4m") as mnt:
        w = writer(mnt / "ckpt")
        big = 8_000  # ~130 KiB of tensors per shard, ~0.8 MiB per step
        w.save_async(1, make_shards(ALL, step=1, numel=big))
        w.flush()
        assert w.take_failures() == []
        filler = mnt / "filler"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free - (64 << 10)))  # leave 64 KiB: less than one shard
        w.save_async(2, make_shards(ALL, step=2, numel=big))
        w.flush()  # does not raise: a failed save is not an error of the writer
        (failed,) = w.take_failures()
        assert failed.step == 2 and "No space left on device" in failed.reason, failed
        assert w.take_failures() == []  # reported once
        assert latest_complete(mnt / "ckpt", num_layers=LAYERS, tp_degree=TP) == 1
        # no leftover of the failed shard write: no temporary marker, no data without a marker
        leftovers = [p.name for p in step_dir(mnt / "ckpt", 2).iterdir()] if step_dir(mnt / "ckpt", 2).exists() else []
        assert not [n for n in leftovers if n.endswith(".tmp")], leftovers
        markers = {n.removesuffix(".done") for n in leftovers if n.endswith(".done")}
        assert {n.rsplit(".", 1)[0] for n in leftovers if not n.endswith(".done")} <= markers, leftovers
        filler.unlink()  # space again: the next save completes
        w.save_async(3, make_shards(ALL, step=3, numel=big))
        w.close()
        assert w.take_failures() == []
        assert latest_complete(mnt / "ckpt", num_layers=LAYERS, tp_degree=TP) == 3
        assert_shards_equal(load_shards(mnt / "ckpt", 3, ALL), make_shards(ALL, step=3, numel=big))


@pytest.mark.timeout(120)
def test_saves_faster_than_the_disk_wait_for_the_writer_and_every_step_is_written(tmp_path: Path) -> None:
    """Saves made back to back (no training between them, so each write outlasts the interval):
    each returns only once the writer has started on the step before, so the step before that is
    on disk already (at most two host copies, a lag of at most one step); every step is written,
    bit for bit, and the waits are recorded."""
    numel = 1 << 18  # ~ 1 MiB of fp32 per weight tensor, 6 shards a step
    steps = range(1, 7)
    w = writer(tmp_path, keep=len(steps))
    for s in steps:
        w.save_async(s, make_shards(ALL, step=s, numel=numel))
        written = {r.step for r in w.records}
        assert set(range(1, s - 1)) <= written, f"after the save of step {s}, only steps {sorted(written)} are on disk"
    w.close()
    assert [r.step for r in w.records] == list(steps)
    assert sum(r.waited_s for r in w.records) > 0
    assert list_steps(tmp_path) == list(steps)
    for s in steps:
        assert_shards_equal(load_shards(tmp_path, s, ALL), make_shards(ALL, step=s, numel=numel))


@pytest.mark.timeout(120)
def test_a_save_that_waits_past_max_wait_is_skipped_and_reported_and_the_rest_are_written(tmp_path: Path) -> None:
    """With no wait allowed (`max_wait_s=0`, a stalled disk's case in miniature), saves made back
    to back while a step still waits are skipped: each is reported once as a failed save naming
    the step it waited behind, the steps not skipped are written bit for bit, and the newest
    complete step is the last one written."""
    numel = 1 << 18
    steps = range(1, 7)
    made = {s: make_shards(ALL, step=s, numel=numel) for s in steps}  # the saves back to back: copies only
    w = writer(tmp_path, keep=len(steps), max_wait_s=0)
    for s in steps:
        w.save_async(s, made[s])
    w.flush()
    failed = w.take_failures()
    w.close()
    skipped = [f.step for f in failed]
    written = [r.step for r in w.records]
    assert skipped, "back-to-back saves of 6 MiB with no wait allowed: some save must find a step waiting"
    assert sorted(skipped + written) == list(steps)
    assert all("skipped: step" in f.reason and "waited" in f.reason for f in failed), [f.reason for f in failed]
    assert w.take_failures() == []
    assert list_steps(tmp_path) == written
    assert latest_complete(tmp_path, num_layers=LAYERS, tp_degree=TP) == written[-1]
    for s in written:
        assert_shards_equal(load_shards(tmp_path, s, ALL), made[s])


def test_max_wait_must_not_be_negative(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_wait_s must be >= 0"):
        writer(tmp_path, max_wait_s=-1)
