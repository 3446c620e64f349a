"""Tier 3: `loom train` end to end on local workers, and its errors for bad configs."""

import json

from loom.cli.main import main


def test_train_runs_and_writes_metrics(tmp_path, capfd, monkeypatch):
    # workers started as users' runs start them (the suite forks its other throwaway workers)
    monkeypatch.setenv("LOOM_START_METHOD", "spawn")
    metrics = tmp_path / "metrics.jsonl"
    code = main(
        ["train", "configs/demo.toml", "--train.steps", "6", "--train.workers", "2", "--parallel.dp", "1",
         "--parallel.optimizer_level", "2", "--train.log_every", "3", "--train.eval_every", "6",
         "--train.metrics_file", str(metrics)]
    )  # fmt: skip
    out = capfd.readouterr().out
    assert code == 0, out
    assert "plan: Mesh(dp=1, tp=2" in out and "optimizer level 2" in out
    assert "accuracy on 100 held-out prompts" in out
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines if line["kind"] == "step"] == [3, 6]
    assert any(line["kind"] == "eval" for line in lines)


def test_unknown_key_is_named_with_the_valid_ones(capfd):
    assert main(["train", "configs/demo.toml", "--train.stpes", "5"]) == 2
    err = capfd.readouterr().err
    assert "stpes" in err and "steps" in err


def test_bad_value_names_the_key_and_range(capfd):
    assert main(["train", "configs/demo.toml", "--parallel.optimizer_level", "5"]) == 2
    assert "parallel.optimizer_level" in capfd.readouterr().err
