"""A tiny `loom train` job for the tier-3 tests: a small GPT on a generated token file."""

import numpy as np

from loom.train.config import TrainConfig
from loom.train.data import write_token_file


def job_config(tmp_path, **sections) -> TrainConfig:
    """The tiny job's config (2 workers, 6 steps), each of `sections` (e.g. `parallel={"pp": 2}`) merged
    over its defaults. The token file is written once per directory. AdamW's `eps` is large enough that its
    steps are Lipschitz in the gradient, so runs on other meshes can be compared (tests/equivalence.py)."""
    tokens = tmp_path / "tokens.bin"
    if not tokens.exists():  # a skewed distribution over 16 tokens: something to learn in a few steps
        write_token_file(tokens, np.random.default_rng(0).integers(0, 16, 20_000) ** 2 % 64)
    config = {
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 16},
        "data": {"kind": "tokens", "path": str(tokens), "seq_len": 16},
        "parallel": {"dp": 2},
        "train": {"steps": 6, "global_batch": 4, "workers": 2, "eval_every": 0, "log_every": 100,
                  "warmup_steps": 2, "lr": 1e-2, "eps": 1e-3},
    }  # fmt: skip
    parallel = sections.get("parallel", {})
    if "plan" in parallel or parallel.get("mode") == "auto":  # the sizes are the plan's: no dp of our own
        del config["parallel"]
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return TrainConfig.from_dict(config)
