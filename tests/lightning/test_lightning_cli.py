"""AsyncCheckpointCallback configured from LightningCLI YAML."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lightning_async_ckpt import AsyncCheckpointCallback, CheckpointStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli_main(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    sys.modules.pop("cli", None)
    import cli

    return cli.main


def test_example_yaml_trains_and_commits(tmp_path, cli_main):
    config = yaml.safe_load((ROOT / "examples" / "async_checkpoint.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    config["trainer"]["max_steps"] = 20
    config["trainer"]["default_root_dir"] = str(tmp_path)  # SaveConfigCallback writes config.yaml there
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(config))

    cli = cli_main(["fit", "--config", str(path)])

    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, AsyncCheckpointCallback)]
    assert len(callbacks) == 1
    assert callbacks[0].every_n_train_steps == 10 and callbacks[0].options.keep_last == 2
    steps = [g.step for g in CheckpointStore(str(tmp_path / "ckpt"), check_writable=False).generations()]
    assert steps == [10, 20]  # keep_last=2 from the YAML


def test_cli_rejects_a_bad_value_by_name(tmp_path, cli_main, capsys):
    config = yaml.safe_load((ROOT / "examples" / "async_checkpoint.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["admission"] = "sometimes"
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(path)])
    assert "admission" in capsys.readouterr().err


@pytest.mark.parametrize("signal_value", ["SIGTERM", "TERM", 15])
def test_yaml_takes_signal_names_and_sizes_with_units(tmp_path, cli_main, signal_value):
    # Issue 39, point 10: Lightning's own requeue_signal takes SIGUSR1 in YAML; the CLI of this library parses 4GiB.
    import signal

    config = yaml.safe_load((ROOT / "examples" / "async_checkpoint.yaml").read_text())
    init_args = config["trainer"]["callbacks"][0]["init_args"]
    init_args.update(dirpath=str(tmp_path / "ckpt"), preemption_signal=signal_value, host_memory_budget="4GiB")
    config["trainer"].update(max_steps=10, default_root_dir=str(tmp_path))
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(config))

    cli = cli_main(["fit", "--config", str(path)])

    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, AsyncCheckpointCallback)]
    assert callback.preemption.signum == signal.SIGTERM
    assert callback.options.host_memory_budget == 4 << 30
    assert callback.committed_step == 10
