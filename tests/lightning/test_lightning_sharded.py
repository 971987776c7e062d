"""AsyncCheckpointCallback under ModelParallelStrategy (FSDP2): every rank writes its shards in torch DCP's format.

The multi-process part is one 2-rank launch (``tests/helpers/lightning_sharded_worker.py``, several fits) shared by the
slow tests below; the rest runs in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_async_ckpt import latest_checkpoint
from lightning_async_ckpt.errors import ConfigError, StorageError
from lightning_async_ckpt.lightning.arguments import check_strategy
from lightning_async_ckpt.lightning.naming import LIGHTNING_META_NAME, model_key_for
from lightning_async_ckpt.sharded import DCP_FORMAT, StoreStorageWriter
from lightning_async_ckpt.storage.store import CheckpointStore
from tests.helpers.dist import launch_ranks
from tests.helpers.lightning_sharded_worker import make_net

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "lightning_sharded_worker.py"


# -- strategy detection (no process group) ------------------------------------------------------------------
def test_sharded_strategies_that_save_dcp_folders_are_accepted():
    check_strategy(ModelParallelStrategy())
    check_strategy(FSDPStrategy(state_dict_type="sharded"))
    assert model_key_for(ModelParallelStrategy()) == "state_dict"
    assert model_key_for(FSDPStrategy(state_dict_type="sharded")) == "model"


@pytest.mark.parametrize(
    ("strategy", "fix"),
    [
        (ModelParallelStrategy(save_distributed_checkpoint=False), "save_distributed_checkpoint=True"),
        (FSDPStrategy(state_dict_type="full"), 'state_dict_type="sharded"'),
    ],
)
def test_sharded_strategies_configured_for_full_checkpoints_are_refused_with_the_fix(strategy, fix):
    with pytest.raises(ConfigError, match=fix):
        check_strategy(strategy)


# -- the generation's extra objects and latest_checkpoint (one process) ----------------------------------------
def _dcp_generation(root: Path, step: int, objects: dict[str, bytes] | None) -> CheckpointStore:
    store = CheckpointStore(str(root))
    writer = StoreStorageWriter(store, step, objects=objects)
    dcp.save({"state_dict": {"w": torch.arange(4.0)}}, storage_writer=writer, no_dist=True)
    assert writer.committed
    return store


def test_meta_pt_is_an_object_of_the_generation_listed_and_verified(tmp_path):
    store = _dcp_generation(tmp_path, 3, {LIGHTNING_META_NAME: b"meta"})
    manifest = store.manifest(3)
    assert manifest.extra["format"] == DCP_FORMAT
    assert LIGHTNING_META_NAME in {o.name for o in manifest.objects}
    assert store.verify(3).ok
    with pytest.raises(StorageError, match="DCP's own"):
        StoreStorageWriter(store, 4, objects={"__0_0.distcp": b""})


def test_latest_checkpoint_returns_the_folder_of_a_lightning_dcp_generation_and_skips_others(tmp_path):
    store = _dcp_generation(tmp_path, 2, {LIGHTNING_META_NAME: b"meta"})
    _dcp_generation(tmp_path, 5, None)  # a raw DCP generation (no meta.pt): Lightning cannot resume from it
    assert latest_checkpoint(str(tmp_path)) == store.url(2)
    # A corrupted object makes the generation unusable: skipped (with a warning), nothing older is left.
    data = tmp_path / "step-00000002" / store.manifest(2).object("__0_0.distcp").key  # the file carries a token
    data.write_bytes(b"x" + data.read_bytes()[1:])
    with pytest.warns(UserWarning, match="skipping generation"):
        assert latest_checkpoint(str(tmp_path)) is None


# -- 2 ranks, ModelParallelStrategy with FSDP2, real Lightning -----------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("lightning_sharded")
    procs = launch_ranks([sys.executable, str(WORKER), str(out)], timeout=400)
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return out, sorted(results, key=lambda r: r["rank"])


def _full(folder: Path, tmp: Path) -> dict:
    target = tmp / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "steps"), [("ours", (4, 8)), ("bn-ours", (2, 4))])
def test_every_generation_holds_what_model_checkpoint_writes_at_the_same_step(runs, tmp_path, kind, steps):
    out, results = runs
    # Parameters and optimizer state were staged behind the fences (the proof held), not copied at the cut.
    assert all(r["deferred_bytes" if kind == "ours" else "bn_deferred_bytes"] > 0 for r in results)
    store = CheckpointStore(str(out / kind), check_writable=False)
    assert [g.step for g in store.generations()] == list(steps)
    sync_dir = out / kind.replace("ours", "sync")
    for step in steps:
        manifest = store.manifest(step)
        assert manifest.extra["format"] == DCP_FORMAT
        assert set(manifest.extra["ranks"]) == {"0", "1"}
        assert store.verify(step).ok
        ours = Path(store.url(step))
        sync = sync_dir / f"step={step}.ckpt"
        # Model and optimizer state (every rank's shards, read back through DCP without a process group).
        full_ours, full_sync = _full(ours, tmp_path), _full(sync, tmp_path)
        assert set(full_ours) == {"state_dict", "optimizer_0"}
        _assert_same(full_ours, full_sync, f"step {step}")
        # Lightning's metadata: loops, epoch, step, schedulers, hyper-parameters (callback states differ: each
        # callback's own bookkeeping).
        meta_ours = torch.load(ours / LIGHTNING_META_NAME, weights_only=False)
        meta_sync = torch.load(sync / LIGHTNING_META_NAME, weights_only=False)
        meta_ours.pop("callbacks"), meta_sync.pop("callbacks")
        _assert_same(meta_ours, meta_sync, f"meta of step {step}")
        assert meta_ours["global_step"] == step


@pytest.mark.slow
def test_resume_from_latest_checkpoint_continues_identically_and_last_finds_the_folder(runs):
    out, results = runs
    for r in results:
        assert r["latest"] == str(out / "ours" / "step-00000008")
        assert r["half_latest"] == str(out / "half" / "step-00000004")
        assert r["resumed_start"] == 4
        assert r["resumed_losses"] == r["losses"][4:]  # the loss curve of the uninterrupted run, bit for bit
        assert r["resumed_equal"]  # final full weights equal the uninterrupted run's
        # ckpt_path="last": the callback's lookup returns the newest committed folder (step 8 of the resumed run).
        assert r["last_start"] == 8 and r["last_steps"] == 2


@pytest.mark.slow
def test_a_two_rank_generation_loads_into_one_process_model_and_optimizer(runs, tmp_path):
    out, _ = runs
    folder = CheckpointStore(str(out / "ours"), check_writable=False).url(8)
    expected = _full(out / "sync" / "step=8.ckpt", tmp_path)
    net = make_net("plain")
    state = {"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}
    dcp.load(state, checkpoint_id=folder)  # no process group: DCP reshards 2 -> 1 on load
    _assert_same(state["state_dict"], expected["state_dict"])
    net.load_state_dict({k[len("net.") :]: v for k, v in state["state_dict"].items()})
    assert torch.equal(net[0].weight, expected["state_dict"]["net.0.weight"])
    # The optimizer's state too, into a one-process Adam through DCP's state-dict API.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    holder = torch.nn.Module()
    holder.net = net
    opt = torch.optim.Adam(holder.parameters(), lr=0.05)
    holder.net(torch.zeros(1, 8)).sum().backward()
    opt.step()
    osd = {"optimizer_0": get_optimizer_state_dict(holder, opt)}
    dcp.load(osd, checkpoint_id=folder)
    set_optimizer_state_dict(holder, opt, optim_state_dict=osd["optimizer_0"])
    _assert_same(osd["optimizer_0"]["state"], expected["optimizer_0"]["state"])
    assert torch.equal(opt.state[net[0].weight]["exp_avg"], expected["optimizer_0"]["state"]["net.0.weight"]["exp_avg"])


@pytest.mark.slow
def test_one_ranks_storage_failure_fails_the_fit_on_every_rank_and_commits_nothing(runs):
    out, results = runs
    for r in results:
        # Both ranks raise (at the next collective point), naming the failing rank; nobody hangs.
        assert r["fault"] is not None and "rank 1" in r["fault"] and "step 4" in r["fault"], r["fault"]
    store = CheckpointStore(str(out / "faulty"), check_writable=False)
    committed = [g.step for g in store.generations() if g.manifest is not None]
    assert committed == [2]  # the failed step has no manifest; the previous generation stays the latest
    assert latest_checkpoint(str(out / "faulty")) == store.url(2)
