"""Checkpoint export to safetensors (read by plain PyTorch) and import back as a weights-only checkpoint."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import loom
from loom.checkpoint import (
    CheckpointError,
    config_path,
    export_model,
    import_model,
    load_checkpoint,
    load_model_weights,
    read_manifest,
    read_model_tensors,
    save_checkpoint,
    save_safetensors,
    verify,
)
from loom.checkpoint.export import saved_plan
from loom.cli.main import main as cli_main
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.plan import Plan
from loom.train import Trainer
from loom.train.config import TrainConfig

SEQ, BATCH = 8, 4
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)
TRAIN_CONFIG = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": SEQ}}
PARALLEL = {"dp": 2, "tp": 2, "optimizer_level": 1}
IDS = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _parallel_gpt(dp, tp):
    mesh = loom.init({"dp": dp, "tp": tp})
    model = GPT(CONFIG, Strategies(dp, tp))
    rows = IDS.chunk(dp)[mesh.dp_rank()]
    loom.parallelize(model, mode="semi_auto", example_inputs=(rows, rows))
    return model, rows


def _full_params(model):
    with model.loom.full_parameters():
        return {name: loom.full(p).detach().clone() for name, p in model.named_parameters()}


def save_case(root):
    """One training step of a GPT on dp=2 x tp=2, saved; its full parameters and global logits."""
    model, rows = _parallel_gpt(2, 2)
    optimizer = make_optimizer(model, torch.optim.AdamW, 1, lr=1e-2)
    trainer = Trainer(model, optimizer)
    trainer.train_step([(rows, rows.roll(1, dims=1))])  # so that the weights are no longer the seeded init
    config = TrainConfig.from_dict(
        {
            **TRAIN_CONFIG,
            "data": {"kind": "tokens", "path": "unused.bin", "seq_len": SEQ},
            "parallel": PARALLEL,
        }
    )
    save_checkpoint(root, trainer, config=config)
    with torch.no_grad():
        logits = loom.full(model(rows)).clone()
    return _full_params(model), logits


def load_case(path):
    """A fresh tp=2 GPT loaded from a checkpoint directory: its full parameters."""
    model, _ = _parallel_gpt(1, 2)
    load_model_weights(path, model)
    return _full_params(model)


def resume_case(root):
    """A tp=2 trainer resumed from the newest checkpoint under `root`: its step and full parameters."""
    model, _ = _parallel_gpt(1, 2)
    trainer = Trainer(model, make_optimizer(model, torch.optim.AdamW, 1, lr=1e-2))
    step = load_checkpoint(root, trainer)
    return step, trainer.step, _full_params(model)


@pytest.fixture(scope="module")
def saved(dist_run, tmp_path_factory):
    """A 4-rank (dp=2 x tp=2) checkpoint at step 1, the full parameters and the logits of IDS."""
    root = tmp_path_factory.mktemp("ckpt")
    params, logits = dist_run(4, save_case, str(root))[0]
    return root, params, logits


def _equal(got, expected):
    return got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected)


def test_safetensors_export_loads_in_plain_pytorch(saved, tmp_path):
    root, params, logits = saved
    out = tmp_path / "model.safetensors"
    assert export_model(root / "step_000001", out) == len(params)
    tensors = load_file(out)
    assert _equal(tensors, params)  # bitwise the distributed model's full parameters
    with safe_open(out, framework="pt") as file:
        metadata = file.metadata()
    assert metadata["step"] == "1"
    model_section = json.loads(metadata["config"])
    assert json.loads(config_path(out).read_text()) == model_section
    model = GPT(GPTConfig.from_dict(model_section))  # plain, unsharded, built from the exported config
    model.load_state_dict(tensors)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), logits)


def test_cli_export_import_roundtrip_onto_tp2(saved, dist_run, tmp_path, capsys):
    root, params, _ = saved
    out = tmp_path / "model.safetensors"
    assert cli_main(["checkpoint", "export", str(root), str(out)]) == 0  # the newest intact one
    assert cli_main(["checkpoint", "import", str(out), str(tmp_path / "init"), "--step", "7"]) == 0
    imported = tmp_path / "init" / "step_000007"
    assert not verify(imported)
    manifest = read_manifest(imported)
    assert (manifest["kind"], manifest["step"], manifest["world_size"]) == ("weights", 7, 1)
    plan = json.loads((imported / "plan.json").read_text())
    assert plan["config"]["model"] == json.loads(config_path(out).read_text())
    assert saved_plan(imported) is None  # a weights file carries no plan
    assert saved_plan(root / "step_000001") == Plan(dp=2, tp=2, optimizer_level=1)  # the run's, loadable
    assert _equal(read_model_tensors(imported), params)
    loaded = dist_run(2, load_case, str(imported))
    assert all(_equal(result, params) for result in loaded)  # bitwise through safetensors and back
    # a run whose checkpoint directory holds the imported weights starts from them, at their step
    for found, step, resumed in dist_run(2, resume_case, str(tmp_path / "init")):
        assert (found, step) == (7, 7) and _equal(resumed, params)
    capsys.readouterr()
    assert cli_main(["checkpoint", "ls", str(tmp_path / "init")]) == 0
    assert cli_main(["checkpoint", "ls", str(root)]) == 0
    imported_row, saved_row = capsys.readouterr().out.splitlines()[1::2]
    assert imported_row.split()[:4] == ["7", "1", "-", "weights"] and imported_row.endswith("ok")
    assert saved_row.split()[:4] == ["1", "4", "1", "full"] and "dp=2, tp=2" in saved_row


def test_pt_export_and_import_with_shared_tensors(saved, tmp_path):
    root, params, _ = saved
    pt = tmp_path / "model.pt"
    export_model(root / "step_000001", pt)
    assert _equal(torch.load(pt, weights_only=True), params)
    path = import_model(pt, tmp_path)  # the config comes from model.config.json beside it
    assert path == tmp_path / "step_000000"
    assert json.loads((path / "plan.json").read_text())["config"]["model"]["d_model"] == CONFIG.d_model
    assert _equal(read_model_tensors(path), params)
    # tied weights under two names share memory, which safetensors' save_file refuses; views too
    weight = torch.arange(12.0).reshape(3, 4)
    tied = {"embedding": weight, "head": weight, "column": weight[:, 1], "row": weight[1]}
    save_safetensors(tied, tmp_path / "tied.safetensors")
    assert _equal(load_file(tmp_path / "tied.safetensors"), tied)
    torch.save(tied, tmp_path / "tied.pt")
    exported = tmp_path / "again.safetensors"
    export_model(import_model(tmp_path / "tied.pt", tmp_path / "tied"), exported)
    assert _equal(load_file(exported), tied)


def test_import_errors_name_the_file(tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors header")
    not_tensors = tmp_path / "counts.pt"
    torch.save({"steps": 3}, not_tensors)
    missing = tmp_path / "missing.safetensors"
    for source, problem in (
        (missing, "no such file"),
        (garbage, "not a readable safetensors file"),
        (not_tensors, "'steps' holds a int, not a tensor"),
    ):
        assert cli_main(["checkpoint", "import", str(source), str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert str(source) in err and problem in err, err
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(2)}, good)
    assert cli_main(["checkpoint", "import", str(good), str(tmp_path / "out")]) == 0
    assert cli_main(["checkpoint", "import", str(good), str(tmp_path / "out")]) == 1  # the target exists
    assert "step_000000: already exists" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="named for step 5"):
        import_model(good, tmp_path / "out" / "step_5", step=6)
    assert cli_main(["checkpoint", "import", str(good), str(tmp_path), "--step", "-1"]) == 2
    assert cli_main(["checkpoint", "export", str(tmp_path / "nowhere"), str(tmp_path / "m.safetensors")]) == 1
    assert "nowhere: no such directory" in capsys.readouterr().err
