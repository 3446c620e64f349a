"""Tier 3: `loom train` on Hugging Face causal LMs (built offline from a config.json, on a text file with a
local tokenizer) with pipelines and tensor parallelism: Llama (rotary positions) on tp=2 x pp=2 and on
dp=2 x pp=2 at optimizer level 3, GPT-2 (a head tied to its token table, copies on both pipeline ranks) on
dp=2 x pp=2, Mixtral (its experts a local region) on dp=2 x tp=2. Each run: the loss falls; a checkpoint
resumes bitwise (the later losses and the final parameters of the uninterrupted run, same machine and mesh);
the export loads with `from_pretrained` and gives the checkpoint's logits and the run's own samples (decoded
on rank 0 from the whole model that `whole_model` gathered). The pipeline's losses are one device's."""

import json
import shutil

import pytest
import torch
from equivalence import RTOL
from hf_job_cases import first_batch, hf_config, hf_job

from loom.checkpoint import read_model_tensors
from loom.cli.main import main
from loom.models import hf
from loom.train.data import build_dataset, load_tokenizer
from loom.train.job import all_stages, run

pytest.importorskip("transformers")

STEPS = 6
CASES = {  # name: (family, [parallel], workers)
    "llama-tp2-pp2": ("llama", {"dp": 1, "tp": 2, "pp": 2, "microbatches": 2}, 4),
    "llama-dp2-pp2-level3": (
        "llama",
        {"dp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe", "optimizer_level": 3},
        4,
    ),
    "gpt2-dp2-pp2": ("gpt2", {"dp": 2, "pp": 2, "microbatches": 2}, 4),
    "mixtral-dp2-tp2": ("mixtral", {"dp": 2, "tp": 2}, 4),
}


# evaluated at steps 3 and 6 on one held-out batch, logged to a metrics file
EVAL = {"eval_every": 3, "eval_batches": 1, "metrics_file": "metrics.jsonl"}


def _job(root, name: str):
    family, parallel, workers = CASES[name]
    train = {"steps": STEPS, "workers": workers, **EVAL, "metrics_file": str(root / "metrics.jsonl")}
    return hf_job(
        root, family, parallel=parallel, train=train,
        checkpoint={"dir": str(root / "ckpt"), "every_steps": 3, "keep_last": 5},
    )  # fmt: skip


def _eval_losses(root) -> list[float]:
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if line["kind"] == "eval"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, worker_pool):
    """`trained(name)`: a 6-step run of case `name`, checkpointed at steps 3 and 6, as (root, summary);
    each case runs once per module, for every test that asks for it."""
    runs = {}

    def get(name: str) -> tuple:
        if name not in runs:
            root = tmp_path_factory.mktemp(name)
            config = _job(root, name)
            runs[name] = root, worker_pool.run(config.train.workers, run, config)[0]
        return runs[name]

    return get


SLOW = pytest.mark.slow
# the resumed Mixtral run costs as much as its first (make test keeps the three pipeline cases)
RESUMED = [*list(CASES)[:3], pytest.param("mixtral-dp2-tp2", marks=SLOW)]


@pytest.mark.parametrize("name", list(CASES))
def test_loss_falls_and_samples_are_text(trained, name):
    root, summary = trained(name)
    losses = summary["losses"]
    assert len(losses) == STEPS and losses[-1] < 0.85 * losses[0], losses
    evaluated = _eval_losses(root)  # the held-out loss falls too
    assert len(evaluated) == 2 and evaluated[1] < evaluated[0], evaluated
    prompt, continuation = summary["text_samples"][0]
    assert prompt.startswith("the cat sat") and continuation  # decoded by the word-level tokenizer


@pytest.mark.parametrize("name", RESUMED)
def test_a_checkpoint_resumes_bitwise(trained, dist_run, tmp_path, name):
    root, summary = trained(name)
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(root / "ckpt" / "step_000003", tmp_path / "ckpt" / "step_000003")
    shutil.copy(root / "corpus.txt", tmp_path)  # the data position is tied to the corpus
    shutil.copytree(root / "tokenizer", tmp_path / "tokenizer")
    shutil.copy(root / f"{CASES[name][0]}.json", tmp_path)
    config = _job(tmp_path, name)
    resumed = dist_run(config.train.workers, run, config)[0]
    assert resumed["first_step"] == 4
    assert resumed["losses"] == summary["losses"][3:]  # bitwise: the same machine and mesh
    final, expected = (read_model_tensors(r / "ckpt" / "step_000006") for r in (tmp_path, root))
    assert final.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(final[key], tensor), key


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(trained, tmp_path, name):
    from transformers import AutoModelForCausalLM

    root, summary = trained(name)
    family = CASES[name][0]
    assert main(["checkpoint", "export", str(root / "ckpt"), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tensors = read_model_tensors(root / "ckpt" / "step_000006")
    trained_model = hf.build_model(hf_config(family), seed=1)  # other weights, replaced by the checkpoint's
    assert set(tensors) == {n for n, _ in trained_model.named_parameters()}  # every parameter, tied once
    trained_model.load_state_dict(tensors, strict=False)  # a tied head is stored under the table's name
    ids = first_batch(_job(root, name))[0]
    with torch.no_grad():
        expected = trained_model(input_ids=ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=RTOL, atol=1e-6)
    # the run's samples came from the whole model gathered on rank 0: the exported model decodes them too
    prompt_ids = build_dataset(_job(root, name).data)[0][0][:8].tolist()  # the job's first prompt
    (continuation,) = hf.greedy(lambda x: exported(input_ids=x).logits, [prompt_ids], 8, 32)
    tokenizer = _tokenizer(root)
    assert summary["text_samples"][0] == (
        tokenizer.decode(prompt_ids, skip_special_tokens=False),
        tokenizer.decode(continuation, skip_special_tokens=False),
    )


def _tokenizer(root):
    return load_tokenizer(str(root / "tokenizer"))


def test_pipeline_losses_are_those_without_a_pipeline(trained, dist_run, tmp_path):
    """The pipeline run's training and evaluation losses equal those of the same job on dp=4 without a
    pipeline (fp32; losses are Lipschitz in the parameters, and AdamW's eps of 1e-3 keeps its steps
    Lipschitz in the gradients)."""
    root, summary = trained("llama-dp2-pp2-level3")
    family = "llama"
    shutil.copy(root / f"{family}.json", tmp_path)
    train = {"steps": STEPS, "workers": 4, **EVAL, "metrics_file": str(tmp_path / "metrics.jsonl")}
    config = hf_job(tmp_path, family, parallel={"dp": 4}, train=train)
    plain = dist_run(4, run, config)[0]["losses"]
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(plain), rtol=RTOL, atol=0)
    evaluated = [_eval_losses(root), _eval_losses(tmp_path)]  # at steps 3 and 6
    assert len(evaluated[0]) == 2
    torch.testing.assert_close(torch.tensor(evaluated[0]), torch.tensor(evaluated[1]), rtol=RTOL, atol=0)


def _four_layers(root, family: str) -> str:
    """A config.json of `family`'s tiny model with 4 layers (2 stages on each of 2 pipeline ranks)."""
    path = root / f"{family}-4.json"
    config = hf_config(family)
    config.num_hidden_layers = 4  # GPT-2's n_layer is the same attribute
    config.to_json_file(path)
    return str(path)


@SLOW
@pytest.mark.parametrize(
    ("family", "schedule", "level", "recompute"),
    [
        ("llama", "interleaved", 1, "none"),
        ("llama", "zero_bubble", 2, "full"),
        ("gpt2", "interleaved", 0, "selective"),
    ],
)
def test_every_schedule_matches_no_pipeline(dist_run, tmp_path, family, schedule, level, recompute):
    """Each schedule of loom train (stages per rank: the schedule's fewest), optimizer level and
    recomputation policy on pp=2, 4 layers: the losses of dp=2 without a pipeline."""
    model = {"hf_config": _four_layers(tmp_path, family)}
    train = {"steps": 4, "workers": 2}
    parallel = {"dp": 1, "pp": 2, "microbatches": 4, "schedule": schedule, "optimizer_level": level}
    piped = hf_job(tmp_path, family, model=model, train=train, parallel={**parallel, "recompute": recompute})
    plain = hf_job(tmp_path, family, model=model, train=train, parallel={"dp": 2})
    losses = [dist_run(2, run, config)[0]["losses"] for config in (piped, plain)]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=RTOL, atol=0)


@SLOW
def test_mixtral_with_tensor_parallel_stages_matches_data_parallel(dist_run, tmp_path):
    """Mixtral on tp=2 x pp=2 at optimizer level 1 (its experts local regions inside the stages; the whole
    model gathered for the samples runs its own experts): the losses and samples of dp=4."""
    train = {"steps": 4, "workers": 4}
    piped = hf_job(
        tmp_path, "mixtral", train=train,
        parallel={"dp": 1, "tp": 2, "pp": 2, "microbatches": 2, "optimizer_level": 1},
    )  # fmt: skip
    plain = hf_job(tmp_path, "mixtral", train=train, parallel={"dp": 4})
    first, second = (dist_run(4, run, config)[0] for config in (piped, plain))
    torch.testing.assert_close(
        torch.tensor(first["losses"]), torch.tensor(second["losses"]), rtol=RTOL, atol=0
    )
    assert first["text_samples"][0][0] == second["text_samples"][0][0] and first["text_samples"][0][1]


# ---- config errors (no workers) ------------------------------------------------------------------------


def test_pipeline_settings_that_cannot_run_are_config_errors(tmp_path):
    pipeline = {"dp": 1, "tp": 2, "pp": 2, "microbatches": 2}
    with pytest.raises(ValueError) as error:  # GPT-2's head is its token table, on both pipeline ranks
        hf_job(tmp_path, "gpt2", parallel=pipeline, train={"workers": 4})
    message = str(error.value)
    assert message.startswith("parallel.pp = 2 with parallel.tp = 2: the model's head is tied"), message
    assert '"tie_word_embeddings": false' in message and "set parallel.tp = 1" in message
    with pytest.raises(ValueError, match=r"parallel.pp = 3 exceeds model.n_layers = 2; lower pp"):
        hf_job(tmp_path, "llama", parallel={"dp": 1, "pp": 3, "microbatches": 3})  # 2 layers
    with pytest.raises(ValueError, match=r"not divisible by parallel.microbatches = 3"):
        hf_job(tmp_path, "llama", parallel={"dp": 2, "pp": 2, "microbatches": 3}).validate(4)
    hf_job(tmp_path, "llama", parallel=pipeline, train={"workers": 4}).validate(4)  # untied: allowed
    two = {"dp": 1, "pp": 2, "microbatches": 2}
    qwen = hf_config("llama").to_dict() | {"model_type": "qwen2"}  # a family loom has no recipe for
    (tmp_path / "qwen2.json").write_text(json.dumps(qwen))
    with pytest.raises(ValueError, match=r"no pipeline recipe for Qwen2ForCausalLM .*use parallel.pp = 1"):
        hf_job(tmp_path, "llama", model={"hf_config": str(tmp_path / "qwen2.json")}, parallel=two)
    router = hf_config("mixtral")
    router.output_router_logits = True
    router.to_json_file(tmp_path / "router.json")
    with pytest.raises(ValueError, match=r'auxiliary router loss .*"output_router_logits": false there'):
        hf_job(tmp_path, "mixtral", model={"hf_config": str(tmp_path / "router.json")}, parallel=two)


def test_uneven_stages_of_a_hugging_face_model(dist_run, tmp_path):
    """`[parallel] stages = [1, 3]` on an unedited 4-layer Llama: the losses are the even split's."""
    config_file = tmp_path / "llama4.json"
    hf_config("llama").__class__(**{**hf_config("llama").to_dict(), "num_hidden_layers": 4}).to_json_file(
        config_file
    )
    parallel = {"dp": 1, "pp": 2, "microbatches": 2}
    even = hf_job(
        tmp_path, "llama", model={"hf_config": str(config_file)}, parallel=parallel, train={"steps": 3}
    )
    uneven = hf_job(
        tmp_path, "llama", model={"hf_config": str(config_file)}, parallel={**parallel, "stages": [1, 3]},
        train={"steps": 3},
    )  # fmt: skip
    stages = all_stages(uneven, hf.build_model(uneven.model.hf_model_config(), seed=0))
    assert [len(stage.blocks) for stage in stages] == [1, 3]
    expected = dist_run(2, run, even)[0]["losses"]
    got = dist_run(2, run, uneven)[0]["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL, atol=0)
