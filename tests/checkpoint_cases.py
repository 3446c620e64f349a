"""What the checkpoint tests share: a tiny GPT, its token data, and a trainer on a dp x tp mesh."""

import torch

import loom
from loom.models.gpt import GPT, GPTConfig, Strategies
from loom.parallel import make_optimizer
from loom.train import Trainer
from loom.train.data import DistributedBatches

SEQ, GLOBAL_BATCH = 8, 8
CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=SEQ)


class Tokens:
    """64 random sequences, each drawn from its own index (the same in every process)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        ids = torch.randint(0, CONFIG.vocab_size, (SEQ + 1,), generator=torch.Generator().manual_seed(index))
        return ids[:-1], ids[1:]


def parallel_gpt(dp, tp):
    """A fresh GPT laid out on a dp x tp mesh, and its data loader."""
    mesh = loom.init({"dp": dp, "tp": tp})
    data = DistributedBatches(Tokens(), GLOBAL_BATCH, mesh.dp_rank(), mesh.dp_size, seed=3)
    model = GPT(CONFIG, Strategies(dp, tp))
    example = torch.zeros(GLOBAL_BATCH // dp, SEQ, dtype=torch.long)
    loom.parallelize(model, mode="semi_auto", example_inputs=(example, example))
    return model, data


def setup(dp, tp, level):
    """A fresh GPT, optimizer (AdamW at `level`), schedule, Trainer and data loader on a dp x tp mesh."""
    model, data = parallel_gpt(dp, tp)
    optimizer = make_optimizer(model, torch.optim.AdamW, level, lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    trainer = Trainer(model, optimizer, lr_scheduler=schedule, clip_grad_norm=0.5)
    return model, trainer, data
