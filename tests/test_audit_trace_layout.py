"""``rrh audit … --trainer-trace``'s arguments, without verl: the layout spec, and what is refused before
anything is joined (the join itself: ``tests/test_audit_trainer_trace.py``, in verl's tox env)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.audit import LayoutError
from harness.audit.trace.join import parse_layout


def test_a_layout_spec_names_megatrons_sizes_and_verls_batching() -> None:
    layout = parse_layout("tp=2, pp=2, dp=4, max_token_len=512, balance_batch=0")
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (2, 2, 4, 16)
    assert layout.batching.max_token_len_per_gpu == 512 and not layout.batching.balance_batch
    assert layout.rank(dp_rank=1, tp_rank=1, pp_rank=1) == 1 + 2 * (1 + 4 * 1), "tp fastest, then dp, then pp"
    assert parse_layout("micro_batch=2").batching.micro_batch_size_per_gpu == 2
    cp = parse_layout("tp=2,cp=2,dp=2,pp=2,micro_batch=1")
    assert (cp.cp, cp.world_size) == (2, 16)
    assert cp.rank(dp_rank=1, tp_rank=1, pp_rank=1, cp_rank=1) == 1 + 2 * (1 + 2 * (1 + 2)), "tp, cp, dp, pp"


def test_replay_r2_names_the_updates_batching_with_verls_config_names() -> None:
    assert parse_layout("max_token_len=8").replay == "R3" and parse_layout("max_token_len=8").update is None
    layout = parse_layout("dp=2,max_token_len=24,replay=R2,ppo_mini_batch=4,ppo_epochs=2,shuffle=1,seed=7,"
                          "ppo_max_token_len=16")  # fmt: skip
    assert layout.replay == "R2" and layout.update is not None
    update = layout.update
    assert (update.mini_batch_size, update.epochs, update.shuffle, update.seed) == (4, 2, True, 7)
    assert update.max_token_len_per_gpu == 16 and update.micro_batch_size_per_gpu is None
    fixed = parse_layout("micro_batch=1,replay=R2,ppo_mini_batch=2,ppo_micro_batch=1").update
    assert fixed is not None and fixed.micro_batch_size_per_gpu == 1
    assert (fixed.epochs, fixed.shuffle, fixed.seed) == (1, False, 42), "verl's defaults"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("max_token_len=8,replay=R1", r"replay=R1: expected one of \['R3', 'R2'\]"),
        ("max_token_len=8,replay=R2,ppo_max_token_len=8", "replay=R2 without ppo_mini_batch=N"),
        (
            "max_token_len=8,ppo_mini_batch=2,ppo_max_token_len=8",
            r"\(ppo_mini_batch, ppo_max_token_len\) without",
        ),
        (
            "max_token_len=8,replay=R2,ppo_mini_batch=2",
            "exactly one of ppo_max_token_len and ppo_micro_batch",
        ),
        (
            "max_token_len=8,replay=R2,ppo_mini_batch=0,ppo_micro_batch=1",
            "mini_batch_size=0: expected an integer",
        ),
        ("tp=2", "exactly one of max_token_len"),
        ("max_token_len=8,micro_batch=2", "exactly one of max_token_len"),
        ("tp=two,max_token_len=8", "'tp=two'; expected NAME=INTEGER"),
        ("vpp=2,max_token_len=8", "'vpp=2'; expected NAME=INTEGER with NAME one of"),
        ("cp=0,max_token_len=8", "cp=0: expected an integer >= 1"),
        ("tp=0,max_token_len=8", "tp=0: expected an integer >= 1"),
    ],
)
def test_a_bad_layout_spec_is_one_error_naming_the_part(spec: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        parse_layout(spec)


def test_trainer_trace_beside_anything_but_a_verl_dump_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import main

    run = tmp_path / "run"
    assert main(["generate", str(run), "--steps", "1"]) == 0
    capsys.readouterr()
    code = main(["audit", str(run), "--trainer-trace", str(tmp_path), "--trainer-layout", "micro_batch=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--trainer-trace" in err and "the run layout; expected a verl RolloutSkip dump" in err, err
