"""What users see: the progress bar, the exception and exit messages, the timeline, help texts, install hints."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from lightning_async_ckpt import AsyncCheckpointCallback, AsyncCheckpointer, CheckpointStore, ConfigError
from lightning_async_ckpt.storage.backend import open_filesystem
from lightning_async_ckpt.tools.cli import build_parser, main
from lightning_async_ckpt.tools.plan_commands import load_bench
from tests.helpers.dist import run_script
from tests.helpers.models import BNDropoutModel, make_loader

ROOT = Path(__file__).resolve().parents[2]


def _trainer(callbacks: list[Callback], max_steps: int = 6, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


# -- progress bar -----------------------------------------------------------------------------------------------
def test_committed_step_shows_as_an_integer_in_the_progress_bar(tmp_path: Path) -> None:
    trainer = _trainer([AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=7)
    model = BNDropoutModel()
    trainer.fit(model, make_loader())
    value = trainer.progress_bar_callback.get_metrics(trainer, model)["ckpt/committed_step"]
    assert isinstance(value, int) and value >= 2
    assert Tqdm.format_num(value) == str(value)  # `12`, not `12.00`


# -- the exception message ------------------------------------------------------------------------------------
class _RaiseAt(Callback):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook == "train_start":
            raise RuntimeError("boom before training")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.hook == "batch_end" and trainer.global_step == 3:
            raise RuntimeError("boom in training")


@pytest.mark.parametrize(("hook", "stopped"), [("train_start", False), ("batch_end", True)])
def test_training_stopped_is_said_only_when_training_was_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, hook: str, stopped: bool
) -> None:
    ckpt = AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)
    trainer = _trainer([ckpt, _RaiseAt(hook)])
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"), pytest.raises(RuntimeError, match="boom"):
        trainer.fit(BNDropoutModel(), make_loader())
    messages = [r.getMessage() for r in caplog.records if r.name == "lightning_async_ckpt"]
    assert any("training stopped by RuntimeError" in m for m in messages) is stopped
    if not stopped:
        assert any("RuntimeError raised during fit, before any training step" in m for m in messages)


class _FailsValidation(BNDropoutModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise RuntimeError("boom in validation")


def test_an_error_in_validate_after_fit_is_not_called_stopped_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _FailsValidation()
    trainer = _trainer([AsyncCheckpointCallback(dirpath=str(tmp_path), every_n_train_steps=2)], max_steps=4)
    trainer.fit(model, make_loader())
    with caplog.at_level(logging.WARNING, logger="lightning_async_ckpt"), pytest.raises(RuntimeError, match="boom"):
        trainer.validate(model, make_loader())
    assert not [r for r in caplog.records if "training stopped" in r.getMessage()]


# -- interpreter exit -----------------------------------------------------------------------------------------
_EXIT_SCRIPT = """
import logging, sys, threading, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore
from lightning_async_ckpt.testing import Fault, register_faulty
register_faulty()
pending = sys.argv[2] == "pending"
faults = [Fault(op="write", path="checkpoint.ckpt", stall=threading.Event())] if pending else []
store = CheckpointStore("faulty://" + sys.argv[1], {"target_protocol": "file", "faults": faults}, check_writable=False)
ckpt = AsyncCheckpointer(store, host_memory_budget=None, drain_timeout_s=0.2)
handle = ckpt.save(1, {"w": torch.ones(4)})
if not pending:
    handle.committed.result()
    ckpt.drain()
# no close(): the interpreter-exit drain runs
"""


@pytest.mark.parametrize("case", ["idle", "pending"])
def test_exit_drain_reports_only_when_something_was_outstanding(tmp_path: Path, case: str) -> None:
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    # Forked from the session's zygote (torch imported once); it still leaves through interpreter exit.
    proc = run_script([sys.executable, str(script), str(tmp_path / "store"), case], timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    if case == "idle":
        assert "interpreter exit" not in proc.stderr
    else:
        assert "interpreter exit: drained 1 outstanding" in proc.stderr and "timed out" in proc.stderr


# -- timeline -------------------------------------------------------------------------------------------------
def _synthetic_saves(n: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for i in range(n):
        t = 100.0 + 2 * i
        outcome = "failed" if i == 7 else "committed"
        events.append({"event": "request", "t": t, "step": i, "decision": "admit", "backlog": 0})
        phases = {
            "cut": [t, t + 0.1],
            "staging": [t, t + 0.3],
            "upload": [t + 0.3, t + 1.5],
            "commit": [t + 1.5, t + 1.6],
        }
        events.append(
            {"event": "save", "t": t + 1.7, "requested_step": i, "outcome": outcome, "t_request": t, "phases": phases}
        )
    return events


def test_timeline_request_panel_is_aggregated_past_the_limit(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from lightning_async_ckpt.tools.timeline import render_timeline
    from lightning_async_ckpt.tools.timeline_requests import MAX_BINS, PER_REQUEST_LIMIT, draw_aggregated

    saves = [e for e in _synthetic_saves(200) if e["event"] == "save"]
    ax = Figure().subplots()
    totals = draw_aggregated(
        ax,
        saves,
        [],
        100.0,
        windows=lambda s: {k: tuple(v) for k, v in s["phases"].items()},
        phases=(("staging", "staging", "y"), ("upload", "upload", "b"), ("commit", "commit", "g"), ("cut", "cut", "r")),
        start_of=lambda s: s["t_request"],
        patch=lambda colour, label: Patch(color=colour, label=label),
    )
    # A bounded number of bars, not one row per request; no per-request labels; the totals stay exact.
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert len(bars) <= 4 * MAX_BINS
    assert not [t for t in ax.get_yticklabels() if t.get_text().startswith("step ")]
    assert totals["cut"] == pytest.approx(200 * 0.1) and totals["staging"] == pytest.approx(200 * 0.2)
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert "median" in legend and "p95" in legend and "failed attempt (1)" in legend
    for n in (PER_REQUEST_LIMIT, 200):
        out = render_timeline(_synthetic_saves(n), tmp_path / f"t{n}.png")
        assert out.stat().st_size > 10_000


# -- help texts, ls -------------------------------------------------------------------------------------------
def _undocumented(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            documented = {a.dest for a in action._choices_actions if a.help}
            missing += [f"{prefix}{name} (command)" for name in action.choices if name not in documented]
            for name, sub in action.choices.items():
                missing += _undocumented(sub, f"{prefix}{name} ")
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(prefix + "/".join(action.option_strings or [action.dest]))
    return missing


def test_every_cli_and_bench_flag_has_help_text() -> None:
    assert _undocumented(build_parser()) == []
    assert _undocumented(load_bench().build_parser(), "bench ") == []


def test_ls_exits_non_zero_on_a_wrong_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(tmp_path / "no-such-store")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- install hints, attach ------------------------------------------------------------------------------------
def test_gs_hint_names_gcsfs_not_a_missing_extra() -> None:
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed: no hint to give")
    with pytest.raises(ConfigError) as info:
        open_filesystem("gs://bucket/run", {})
    assert "pip install gcsfs" in str(info.value) and "lightning_async_ckpt[" not in str(info.value)


def test_attach_returns_the_checkpointer(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = AsyncCheckpointer(CheckpointStore(str(tmp_path)), host_memory_budget=None).attach(model, optimizer)
    try:
        assert isinstance(ckpt, AsyncCheckpointer)
        model(torch.ones(1, 4)).sum().backward()
        handle = ckpt.save(1, {"model": model.state_dict()}, modules=[model], optimizers=[optimizer])
        optimizer.step()
        assert handle.committed.result(60).step == 1
    finally:
        ckpt.close()
    assert json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())["step"] == 1
