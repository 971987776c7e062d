"""Sharded (DCP) generations in the store: the commit through GenerationWriter, a prefixed claim, listing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightning_async_ckpt.sharded import ShardedCheckpointer
from lightning_async_ckpt.storage.manifest import MANIFEST_NAME
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.writer import CLAIM_NAME
from tests.helpers.sharded_worker import make_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _foreign_claim(root, step: int) -> None:
    """A claim on ``step`` by a writer on another host: alive as far as this host can tell."""
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    body = {"run_id": "other", "step": step, "token": "t0", "host": "another-host", "pid": 1, "started": 0}
    (folder / CLAIM_NAME).write_text(json.dumps(body))


def test_a_step_claimed_by_another_writer_is_written_under_its_own_prefix_and_loads_with_dcp(tmp_path):
    _foreign_claim(tmp_path, 4)
    (tmp_path / "step-00000004" / "__0_0.distcp").write_bytes(b"the other writer's data")
    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        manifest = ckpt.save(4, _state(model, opt)).result(timeout=60)
    folder = manifest.dcp_folder
    assert folder and folder.startswith("w-")
    token = folder.removeprefix("w-")  # the attempt's data files carry its token
    assert {e.key for e in manifest.objects} == {f"{folder}/.metadata", f"{folder}/__0_0.distcp.{token}"}
    # The other writer's files are untouched.
    assert (tmp_path / "step-00000004" / "__0_0.distcp").read_bytes() == b"the other writer's data"
    store = CheckpointStore(str(tmp_path))
    info = store.latest()
    assert info.step == 4 and store.verify(4).ok
    assert info.checkpoint_format == "torch_dcp" and info.dcp_path == f"{info.path}/{folder}"
    target = {"model": make_model().state_dict()}
    dcp.load(target, checkpoint_id=info.dcp_path, planner=DefaultLoadPlanner(allow_partial_load=True))
    for key, value in model.state_dict().items():
        assert torch.equal(target["model"][key], value), key


def test_a_dcp_generation_names_its_format_folder_and_ranks(tmp_path):
    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        manifest = ckpt.save(1, _state(model, opt)).result(timeout=60)
    assert manifest.checkpoint_format == "torch_dcp" and manifest.dcp_folder == ""
    assert [e.name for e in manifest.ranks[0]] == ["__0_0.distcp"]
    info = CheckpointStore(str(tmp_path)).latest()
    assert info.dcp_path == info.path
    assert (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


def test_a_single_writer_generation_is_torch_save_without_a_dcp_path(tmp_path):
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(1)
    writer.write_bytes("checkpoint.ckpt", b"x")
    manifest = writer.commit()
    assert manifest.checkpoint_format == "torch_save" and manifest.dcp_folder is None and manifest.ranks == {}
    assert store.latest().dcp_path is None


def test_cli_ls_and_verify_show_the_ranks_and_their_bytes(tmp_path, capsys):
    from lightning_async_ckpt.tools.cli import main

    model, opt = _trained()
    with ShardedCheckpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, _state(model, opt)).result(timeout=60)
    data_file = tmp_path / "step-00000001" / CheckpointStore(str(tmp_path)).manifest(1).object("__0_0.distcp").key
    data = data_file.stat().st_size
    assert main(["ls", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["format"] == "torch_dcp" and row["ranks"] == {"0": data}
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "RANKS" in lines[0].split() and "0:" in lines[1]
    assert main(["verify", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["ranks"] == {"0": data}
    data_file.write_bytes(b"torn")  # any rank's object is checked
    assert main(["verify", str(tmp_path)]) == 1
    assert "__0_0.distcp" in capsys.readouterr().out
