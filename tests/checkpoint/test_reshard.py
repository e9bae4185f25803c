"""Reading checkpoints for a resumed run, in one process: resharding across tensor-parallel
degrees (against the model's own slicing of the full tensors), CRC-32 detection of a corrupt
shard, the fallback past an incomplete or corrupt newest step, refusal of another model shape,
and version-1 markers still read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from elastic.engine.checkpoint.files import CheckpointError, marker_path, read_marker, step_dir
from elastic.engine.checkpoint.load import load_shards
from elastic.engine.checkpoint.reshard import KINDS, CheckpointMismatch, layer_parameters, load_resharded
from elastic.engine.checkpoint.resume import find_resume_point
from elastic.engine.checkpoint.writers import CheckpointWriter
from elastic.model.config import GPTConfig, get_preset
from elastic.model.gpt import GPTStage
from elastic.model.init import shard_tensor
from elastic.model.naming import layer_of
from elastic.transfer.shards import ShardKey

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

CFG = get_preset("tiny")
LAYERS = CFG.num_layers


def full_state(seed: int, cfg: GPTConfig = CFG) -> dict[str, torch.Tensor]:
    """Every canonical tensor of tiny's shards at full size: initial parameters, random moments,
    and one AdamW step count per layer."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in GPTStage(cfg).named_parameters():
        out[f"param/{name}"] = p.detach().clone()
        out[f"exp_avg/{name}"] = torch.randn(p.shape, generator=g)
        out[f"exp_avg_sq/{name}"] = torch.rand(p.shape, generator=g)
    return out


def shards_at(full: dict[str, torch.Tensor], degree: int, *, step: int,
              cfg: GPTConfig = CFG) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """The (layer, tp_rank) shards of `full` at `degree`, cut with the model's slicing."""
    out: dict[ShardKey, dict[str, torch.Tensor]] = {}
    for layer in range(cfg.num_layers):
        for t in range(degree):
            shard = {"step": torch.tensor(step + layer, dtype=torch.int64)}
            for name, split in layer_parameters(cfg, layer).items():
                for kind in KINDS:
                    shard[f"{kind}/{name}"] = shard_tensor(full[f"{kind}/{name}"], split.tp_dim, t, degree,
                                                           layout=split.layout).clone()
            out[ShardKey(layer, t)] = shard
    return out


def write(directory: Path, step: int, degree: int, full: dict[str, torch.Tensor], cfg: GPTConfig = CFG) -> None:
    w = CheckpointWriter(directory, num_layers=cfg.num_layers, tp_degree=degree, keep=5)
    w.save_async(step, shards_at(full, degree, step=step, cfg=cfg))
    w.close()


def assert_equal(got: dict[ShardKey, dict[str, torch.Tensor]], want: dict[ShardKey, dict[str, torch.Tensor]]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].keys() == want[key].keys(), key
        for name, t in want[key].items():
            assert torch.equal(got[key][name], t), (key, name)
            assert got[key][name].is_contiguous()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("written", "read"), [(2, 1), (2, 4), (4, 2), (1, 2)])
def test_a_checkpoint_reads_at_any_degree_as_the_model_would_slice_it(tmp_path: Path, written: int, read: int) -> None:
    full = full_state(0)
    write(tmp_path, 10, written, full)
    keys = [ShardKey(layer, t) for layer in range(LAYERS) for t in range(read)]
    assert_equal(load_resharded(tmp_path, 10, keys, cfg=CFG, tp_degree=read), shards_at(full, read, step=10))
    # every layer's AdamW step count is carried over; layer_of agrees with the names resharded
    some = load_resharded(tmp_path, 10, [ShardKey(3, 0)], cfg=CFG, tp_degree=read)[ShardKey(3, 0)]
    assert int(some["step"]) == 13
    assert {layer_of(n.split("/", 1)[1], CFG) for n in some if n != "step"} == {3}


SHARED_KV = get_preset("llama-tiny").with_overrides(n_kv_heads=2)
"""Two key/value heads for eight query heads: shared by two ranks each at degree 4 (model/kv_layout.py)."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("written", "read"), [(4, 1), (1, 4), (4, 2), (2, 4)])
def test_shared_key_value_heads_reshard_to_any_degree(tmp_path: Path, written: int, read: int) -> None:
    full = full_state(1, SHARED_KV)
    write(tmp_path, 10, written, full, SHARED_KV)
    keys = [ShardKey(layer, t) for layer in range(SHARED_KV.num_layers) for t in range(read)]
    got = load_resharded(tmp_path, 10, keys, cfg=SHARED_KV, tp_degree=read)
    assert_equal(got, shards_at(full, read, step=10, cfg=SHARED_KV))
    if read == 4:  # the replicas of a key/value head hold the same rows, the query rows differ
        qkv = [got[ShardKey(1, t)]["param/blocks.0.attn.qkv.weight"] for t in range(4)]
        kv = slice(SHARED_KV.n_head // 4 * SHARED_KV.head_dim, None)
        assert torch.equal(qkv[0][kv], qkv[1][kv]) and not torch.equal(qkv[1][kv], qkv[2][kv])


def flip_bytes(directory: Path, step: int, key: ShardKey) -> Path:
    """Flip bytes in the middle of the largest data file of one shard; its path."""
    marker = read_marker(directory, step, key)
    assert marker is not None
    files = sorted((step_dir(directory, step) / marker.data).rglob("*.distcp"), key=lambda p: p.stat().st_size)
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    victim.write_bytes(bytes(data))
    return victim


@pytest.mark.timeout(60)
def test_a_corrupt_newest_checkpoint_is_detected_and_the_one_before_is_used(tmp_path: Path) -> None:
    write(tmp_path, 5, 2, full_state(5))
    write(tmp_path, 10, 2, full_state(10))
    assert find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path).step == 10
    flip_bytes(tmp_path, 10, ShardKey(2, 1))
    with pytest.raises(CheckpointError, match=r"layer-0002-tp-01 of step 10 .* is corrupt: .* CRC-32"):
        load_shards(tmp_path, 10, [ShardKey(2, 1)])
    source = find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path)
    assert source.step == 5 and source.tp_degree == 2
    assert [s.step for s in source.skipped] == [10] and "corrupt" in source.skipped[0].why
    assert "skipped the checkpoint of step 10" in source.describe()
    keys = [ShardKey(layer, 0) for layer in range(LAYERS)]
    assert_equal(load_resharded(tmp_path, 5, keys, cfg=CFG, tp_degree=1), shards_at(full_state(5), 1, step=5))


@pytest.mark.timeout(60)
def test_an_incomplete_newest_checkpoint_falls_back_and_none_usable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path)
    write(tmp_path, 5, 1, full_state(5))
    write(tmp_path, 10, 1, full_state(10))
    marker_path(tmp_path, 10, ShardKey(4, 0)).unlink()  # its writer never committed it
    source = find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path)
    assert source.step == 5 and "incomplete" in source.skipped[0].why and "layer-0004-tp-00" in source.skipped[0].why
    flip_bytes(tmp_path, 5, ShardKey(0, 0))
    with pytest.raises(CheckpointError, match=r"no usable checkpoint: step 10: .*incomplete.*; step 5: .*corrupt"):
        find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path)


@pytest.mark.timeout(60)
def test_a_checkpoint_of_another_model_shape_is_refused(tmp_path: Path) -> None:
    write(tmp_path, 5, 2, full_state(0))
    wider = CFG.with_overrides(d_model=256)
    with pytest.raises(CheckpointMismatch, match=r"another model shape: .* at tensor-parallel degree 2"):
        find_resume_point(tmp_path, wider, checkpoint_dir=tmp_path)
    deeper = CFG.with_overrides(n_layer=6)
    with pytest.raises(CheckpointMismatch, match="6 planning layers .* this model has 8"):
        find_resume_point(tmp_path, deeper, checkpoint_dir=tmp_path)


@pytest.mark.timeout(60)
def test_version_1_markers_are_still_read(tmp_path: Path) -> None:
    full = full_state(1)
    write(tmp_path, 5, 2, full)
    for layer in range(LAYERS):
        for t in range(2):
            path = marker_path(tmp_path, 5, ShardKey(layer, t))
            body = json.loads(path.read_text())
            v1 = {k: body[k] for k in ("step", "layer", "tp_rank", "data", "names")}
            path.write_text(json.dumps({"version": 1, **v1}))
    marker = read_marker(tmp_path, 5, ShardKey(0, 0))
    assert marker is not None and marker.version == 1 and marker.checksums is None
    assert find_resume_point(tmp_path, CFG, checkpoint_dir=tmp_path).tp_degree == 2
    keys = [ShardKey(layer, 0) for layer in range(LAYERS)]
    assert_equal(load_resharded(tmp_path, 5, keys, cfg=CFG, tp_degree=1), shards_at(full, 1, step=5))


@pytest.mark.timeout(60)
def test_a_resumed_run_must_keep_the_samples_of_every_step() -> None:
    from elastic.records.optim_config import OptimConfig
    from elastic.records.resume import CheckpointManifest, compare_runs

    earlier = CheckpointManifest(model="tiny", model_config=CFG, global_batch=8, data_seed=0, data_path=None,
                                 optim=OptimConfig())
    assert compare_runs(earlier, earlier) == ([], [])
    for change, word in (({"global_batch": 16}, "global batch"), ({"data_seed": 1}, "data seed"),
                         ({"data_path": "x.bin"}, "data (--data)"),
                         ({"model_config": CFG.with_overrides(n_head=8)}, "another model shape (n_head 4 -> 8)"),
                         ({"model_config": CFG.with_overrides(arch="llama")}, "(arch gpt2 -> llama)"),
                         ({"model_config": CFG.with_overrides(arch="llama", ffn_hidden=512, n_kv_heads=2)},
                          "(arch gpt2 -> llama, kv_heads 4 -> 2)"),
                         ({"model_config": CFG.with_overrides(tie_embeddings=True)}, "(tie_embeddings False -> True)")):
        refusals, _ = compare_runs(earlier, dataclasses.replace(earlier, **change))  # type: ignore[arg-type]
        assert len(refusals) == 1 and word in refusals[0], refusals
    refusals, notes = compare_runs(earlier, dataclasses.replace(earlier, optim=OptimConfig(lr=3e-4)))
    assert refusals == [] and len(notes) == 1 and "optimizer" in notes[0]


@pytest.mark.timeout(60)
def test_resuming_into_the_same_directory_sets_the_newer_steps_aside(tmp_path: Path) -> None:
    from elastic.records.resume import CheckpointManifest, ResumeSource
    from elastic.roles.launcher import _prepare_checkpoints
    from tests.faults.runs import tiny_config

    config = tiny_config(tmp_path, nodes=2, pipelines=2, steps=20)
    checkpoints = Path(config.checkpoint_path)
    for step in (5, 10, 15):
        step_dir(checkpoints, step).mkdir(parents=True)
    source = ResumeSource(run_dir=str(tmp_path), checkpoint_dir=str(checkpoints), step=5, tp_degree=1)
    _prepare_checkpoints(dataclasses.replace(config, resume=source))
    assert [p.name for p in checkpoints.glob("step-*")] == ["step-00000005"]
    aside = list(checkpoints.glob("set-aside-*/step-*"))
    assert sorted(p.name for p in aside) == ["step-00000010", "step-00000015"]
    manifest = CheckpointManifest.load(checkpoints)
    assert manifest is not None and manifest.global_batch == 8 and manifest.model_config == CFG
