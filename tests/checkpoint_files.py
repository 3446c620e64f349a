"""What the untrusted-file and bad-input checkpoint tests share: a tiny one-process checkpoint, and the
manifest re-hashed after a file was changed (as an attacker can always do)."""

from pathlib import Path

import torch

from loom.checkpoint import manifest as mf
from loom.checkpoint import read_manifest, save_checkpoint
from loom.train import Trainer


def trainer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def saved(root: Path, lr=None) -> Path:
    """A one-process checkpoint at step 1 under `root` (with `lr` as the optimizer's setting); its
    directory."""
    t = trainer()
    t.model(torch.randn(5, 4)).pow(2).mean().backward()
    t.optimizer.step()
    t.step = 1
    if lr is not None:
        t.optimizer.param_groups[0]["lr"] = lr
    return save_checkpoint(root, t)


def rehash(checkpoint: Path) -> None:
    """Rewrite the manifest to match the files as they are now."""
    info = {k: v for k, v in read_manifest(checkpoint).items() if k not in ("files", "format")}
    mf.write_manifest(checkpoint, info)
    assert mf.verify(checkpoint) == []
