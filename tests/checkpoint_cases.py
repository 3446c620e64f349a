"""What the checkpoint tests share: a tiny GPT, its token data, and a trainer on a dp x tp mesh."""

import torch
import torch.distributed as dist

import loom
from loom.checkpoint.chunks import Pieces
from loom.checkpoint.state import optimizer_state
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


def whole_states(model, optimizer):
    """Every parameter's optimizer states as whole tensors on every rank (collective), by parameter name:
    DTensors gathered; at levels 1-3 every rank's pieces of its chunks put together, and the scalars that
    the ranks holding a parameter's pieces keep."""
    state = optimizer_state(model, optimizer) or {"state": {}}
    mine, whole = {}, {}
    for name, states in state["state"].items():
        for key, value in states.items():
            if hasattr(value, "to_local"):
                whole.setdefault(name, {})[key] = loom.full(value).clone()
            elif isinstance(value, Pieces):
                boxes = [(p.offsets, p.values.clone()) for p in value.pieces]
                mine.setdefault(name, {})[key] = ("pieces", value.size, value.dtype, boxes)
            else:
                mine.setdefault(name, {})[key] = ("value", value.clone() if torch.is_tensor(value) else value)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for held in everyone:
        for name, states in held.items():
            for key, (kind, *content) in states.items():
                if kind == "value":
                    whole.setdefault(name, {})[key] = content[0]
                    continue
                size, dtype, boxes = content
                target = whole.setdefault(name, {}).setdefault(key, torch.zeros(size, dtype=dtype))
                for offsets, values in boxes:
                    target[tuple(slice(o, o + n) for o, n in zip(offsets, values.shape, strict=True))] = (
                        values
                    )
    return whole
