"""`loom train` with `[parallel] sync = "local_sgd" | "diloco"` (loom.train.replicas) on 2 gloo ranks, one
replica each, and on 4 in replicas of several ranks (tier 3: the main job).

- DiLoCo's (and local SGD's) losses fall, and the only all-reduces of its steps are the syncs, every `sync_every` steps, of
  the parameters' bytes (counted as tests/test_local_sgd.py counts them, per step by the heartbeats);
- exactness (fp32, inner SGD without momentum, decay or clipping): `sync_every = 1` with outer SGD(lr 1,
  momentum 0) is synchronous data parallelism, losses and parameters within 1e-6;
- a replica killed mid-step (SIGKILL through LOOM_FAULTS' `Fault`) restarts the job from the last
  checkpoint, taken between two syncs with a fragment's average in flight, and the run ends bitwise as the
  uninterrupted one: every rank's parameters, inner and outer states, and losses;
- each replica of tp = 2 ranks computes what a replica of one process does (slow: 4 ranks);
- replicas of several ranks (4 ranks, the "replica" mesh axis outermost): a replica's mesh and groups (slow); 2
  replicas of dp 2 at optimizer levels 1 and 3 (level 3 slow) are synchronous dp 4, 2 replicas of pp 2 are
  synchronous dp 2 x pp 2 (slow), and on 8 ranks replicas of dp 2 x pp 2 (level 1) and of dp 2 x tp 2
  (level 2) their synchronous runs (slow), under the identity outer step; with pp 2 inside, the only all-reduces
  between replicas are the syncs, of each rank's stage bytes (slow); a replica of dp 2 at levels 2 and 3
  and one of pp 2 resume bitwise after a kill (slow);
- bad `[parallel]` settings are refused naming the key and the fix, and so is a checkpoint without this
  rank's replica entry (one of synchronous training), one saved by another number of ranks, or one saved
  under another sync or other sync settings.
"""

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from job_cases import job_config
from torch.distributed.checkpoint.metadata import Metadata

import loom
from loom.checkpoint import read_model_tensors
from loom.checkpoint.manifest import CheckpointError
from loom.checkpoint.safe import SafeLoadPlanner, SafeReader
from loom.checkpoint.state import load_replica_state, replica_load_template
from loom.cli.train import restart_policy
from loom.dist import launch
from loom.fault import Fault, supervise
from loom.models.gpt import GPT
from loom.parallel.local_sgd import DiLoCo, LocalSGD
from loom.train.config import TrainConfig
from loom.train.job import all_stages, run
from loom.train.replicas import data_position, outer_group, replica_group, replica_mesh, replicas_mesh_sizes

TOL = 1e-6


def _config(tmp_path, name: str, parallel: dict, train: dict | None = None, **sections) -> TrainConfig:
    return job_config(
        tmp_path, parallel={"dp": 2, **parallel}, train={"eval_every": 0, **(train or {})},
        checkpoint={"dir": str(tmp_path / name), "every_steps": 2, "keep_last": 10}, **sections,
    )  # fmt: skip


def _counted_run(config: TrainConfig, replica_ranks: int | None = None) -> tuple[dict, dict[int, list[int]]]:
    """`run(config)` on this rank, with the bytes of each `dist.all_reduce` by the training step issuing it
    (0: before the first step; the heartbeat after step s is the end of step s). With `replica_ranks`, only
    those between replicas: over a group whose ranks lie in several replicas of that many consecutive ranks."""
    calls: dict[int, list[int]] = {}
    last = [0]
    original = dist.all_reduce

    def beat(step, phase) -> None:
        if step is not None:
            last[0] = step

    def between_replicas(group) -> bool:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return len({rank // replica_ranks for rank in ranks}) > 1

    def record(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)  # all_reduce(tensor, op, group, ...)
        if replica_ranks is None or between_replicas(group):
            calls.setdefault(last[0] + 1, []).append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    launch.BEAT_HOOKS.append(beat)
    dist.all_reduce = record
    try:
        return run(config), calls
    finally:
        dist.all_reduce = original
        launch.BEAT_HOOKS.remove(beat)


@pytest.mark.parametrize("sync", ["diloco", pytest.param("local_sgd", marks=pytest.mark.slow)])
def test_replicas_learn_and_all_reduce_only_at_syncs(dist_run, tmp_path, sync):
    steps, every = 9, 3
    config = _config(tmp_path, "count", {"sync": sync, "sync_every": every}, {"steps": steps})
    done = dist_run(2, _counted_run, config)
    param_bytes = 4 * sum(p.numel() for p in GPT(config.model.gpt_config()).parameters())  # fp32, tied once
    for summary, calls in done:
        losses = summary["losses"]
        assert len(losses) == steps and losses[-1] < losses[0] - 1.0, losses
        during = {step: sizes for step, sizes in calls.items() if 1 <= step <= steps}
        assert during == {s: [param_bytes] for s in range(every, steps + 1, every)}, during


def _sgd(sync: dict) -> dict:
    """Inner SGD without momentum, decay or clipping: steps linear in the gradient, so averaging the
    replicas' steps is stepping on their averaged gradient."""
    train = {"optimizer": "sgd", "momentum": 0.0, "weight_decay": 0.0, "clip_grad_norm": None, "lr": 0.05}
    return {"parallel": sync, "train": {**train, "steps": 6}}


@pytest.mark.slow  # two runs; tests/test_local_sgd.py checks the same identity on the optimizer alone
def test_diloco_every_step_with_identity_outer_step_is_data_parallelism(dist_run, tmp_path):
    identity = {"sync": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
    runs = {}
    for name, sync in (("dp", {}), ("diloco", identity)):
        case = _sgd(sync)
        done = dist_run(2, run, _config(tmp_path, name, case["parallel"], case["train"]))
        final = read_model_tensors(tmp_path / name / "step_000006")
        runs[name] = ([r["losses"] for r in done], final)
    (dp_losses, dp_params), (replica_losses, replica_params) = runs["dp"], runs["diloco"]
    # the data-parallel loss is the mean over the ranks; each replica reports its own
    means = [sum(pair) / 2 for pair in zip(*replica_losses, strict=True)]
    assert means == pytest.approx(dp_losses[0], rel=TOL, abs=TOL)
    assert replica_params.keys() == dp_params.keys()
    for name, value in dp_params.items():
        torch.testing.assert_close(replica_params[name], value, rtol=TOL, atol=TOL, msg=name)


def _replica_entries(checkpoint) -> dict[str, dict]:
    """Every rank's local SGD / DiLoCo entry of a checkpoint (`loom.checkpoint.state.replica_state`)."""
    reader = SafeReader(checkpoint / "dcp")
    keys = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("optim.replicas.")]
    state = {"optim": {"replicas": {key.removeprefix("optim.replicas."): None for key in keys}}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return {rank: entry for rank, (entry,) in state["optim"]["replicas"].items()}


def _assert_equal(a, b, where: str = "") -> None:
    """Nested states equal bitwise."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_a_killed_replica_resumes_bitwise(tmp_path):
    # syncs every 4 steps in 2 fragments (steps 2 and 4 mod 4), each landing a step later: the checkpoints
    # of steps 2 and 4 hold an average in flight, and step 4's replicas differ from each other
    sync = {"sync": "diloco", "sync_every": 4, "fragments": 2, "fragment_delay": 1}
    fault = {"heartbeat_timeout_s": 120}  # a SIGKILL shows through the sentinels
    results = {}
    for name, faults in (("clean", []), ("killed", [Fault(kind="sigkill", rank=1, step=5)])):
        config = _config(tmp_path, name, sync, {"steps": 7}, fault=fault)
        done = supervise(run, 2, config, faults, policy=restart_policy(config), log=print)
        assert len(done.events) == len(faults)
        results[name] = (done, _replica_entries(tmp_path / name / "step_000007"))
    (clean, clean_state), (killed, killed_state) = results["clean"], results["killed"]
    assert killed.events[0].kind == "died" and killed.events[0].step == 4
    for rank in range(2):  # the restart resumed from step 4 and ran steps 5-7 as the clean run did
        assert killed.results[rank]["losses"] == clean.results[rank]["losses"][4:]
    assert clean_state.keys() == {"rank_00000", "rank_00001"}
    _assert_equal(killed_state, clean_state)
    one, other = (clean_state[f"rank_0000{r}"]["params"] for r in range(2))
    assert any(not torch.equal(a, b) for a, b in zip(one, other, strict=True))  # the replicas do differ


@pytest.mark.slow  # 4 ranks, two supervised runs each
@pytest.mark.parametrize(
    ("inside", "during"),
    [({"dp": 4, "replicas": 2, "optimizer_level": 2}, "step"), ({"dp": 4, "replicas": 2, "optimizer_level": 3}, "step"),
     ({"dp": 2, "pp": 2, "microbatches": 2}, "save")],
    ids=["level2", "level3", "pp2"],
)  # fmt: skip
def test_a_killed_replica_of_several_ranks_resumes_bitwise(tmp_path, inside, during):
    # as test_a_killed_replica_resumes_bitwise, each replica data-parallel inside with its optimizer states
    # (and parameters) sharded over its dp ranks, or pipelined; rank 1 is in replica 0. A pipeline's steps
    # take no step faults: its rank dies writing step 6's checkpoint, so the run resumes from step 4 too
    sync = {"sync": "diloco", "sync_every": 4, "fragments": 2, "fragment_delay": 1, **inside}
    fault = {"heartbeat_timeout_s": 120}
    kill = Fault(kind="sigkill", rank=1, step=5 if during == "step" else 6, during=during)
    results = {}
    for name, faults in (("clean", []), ("killed", [kill])):
        config = _config(tmp_path, name, sync, {"steps": 7, "workers": 4}, fault=fault)
        done = supervise(run, 4, config, faults, policy=restart_policy(config), log=print)
        assert len(done.events) == len(faults)
        results[name] = (done, _replica_entries(tmp_path / name / "step_000007"))
    (clean, clean_state), (killed, killed_state) = results["clean"], results["killed"]
    assert killed.events[0].kind == "died"
    for rank in range(4):
        assert killed.results[rank]["losses"] == clean.results[rank]["losses"][4:]
    assert clean_state.keys() == {f"rank_0000{r}" for r in range(4)}
    _assert_equal(killed_state, clean_state)
    one, other = (clean_state[f"rank_0000{r}"]["params"] for r in (0, 2))  # replicas 0 and 1, same shards
    assert any(not torch.equal(a, b) for a, b in zip(one, other, strict=True))
    plan = json.loads((tmp_path / "clean" / "step_000007" / "plan.json").read_text())
    assert plan["optimizer_level"] == inside.get("optimizer_level", 0)  # the replicas' inner optimizer's


@pytest.mark.slow  # 4 ranks: replicas of tp = 2
def test_tensor_parallel_replicas_compute_as_one_process_replicas(dist_run, tmp_path):
    sync = {"sync": "diloco", "sync_every": 2}
    whole = dist_run(2, run, _config(tmp_path, "whole", sync, {"steps": 4}))
    cut = dist_run(4, run, _config(tmp_path, "cut", {**sync, "tp": 2}, {"steps": 4, "workers": 4}))
    for rank in range(4):  # ranks 0, 1 are replica 0; ranks 2, 3 replica 1
        assert cut[rank]["losses"] == pytest.approx(whole[rank // 2]["losses"], rel=1e-5)
    expected = read_model_tensors(tmp_path / "whole" / "step_000004")
    got = read_model_tensors(tmp_path / "cut" / "step_000004")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# replicas of several ranks (4 gloo ranks): 2 replicas, each data-parallel (dp 2) or pipelined (pp 2) inside
INSIDE = {
    "level1": ({"dp": 4, "replicas": 2, "optimizer_level": 1}, {"dp": 4, "optimizer_level": 1}),
    "level3": ({"dp": 4, "replicas": 2, "optimizer_level": 3}, {"dp": 4, "optimizer_level": 3}),
    "pp2": ({"dp": 2, "pp": 2, "microbatches": 2}, {"dp": 2, "pp": 2, "microbatches": 2}),
    # 8 ranks: dp 2 x pp 2 (level 1) and dp 2 x tp 2 (level 2) inside each replica
    "pp2_level1": (
        {"dp": 4, "replicas": 2, "pp": 2, "microbatches": 2, "optimizer_level": 1},
        {"dp": 4, "pp": 2, "microbatches": 2, "optimizer_level": 1},
    ),
    "tp2_level2": (
        {"dp": 4, "replicas": 2, "tp": 2, "optimizer_level": 2},
        {"dp": 4, "tp": 2, "optimizer_level": 2},
    ),
}


def _replica_mesh_groups():
    mesh = loom.init(replicas_mesh_sizes(TrainConfig.from_dict(
        {"parallel": {"dp": 2, "pp": 2, "replicas": 2, "sync": "diloco", "microbatches": 2}}
    ), 4))  # fmt: skip
    inner = replica_mesh(mesh)
    ranks = dist.get_process_group_ranks
    whole = mesh.without("dp")  # an axis of size 1 leaves the same devices
    return (
        repr(mesh), repr(inner), ranks(inner.group({"pp": None})), ranks(replica_group(mesh)),
        ranks(outer_group(mesh)), data_position(mesh), repr(whole), ranks(whole.group({"replica": None})),
    )  # fmt: skip


@pytest.mark.slow  # 4 ranks (make test's 4-rank case is the level-1 one below, which builds such meshes too)
def test_a_replica_mesh_is_the_world_without_its_outermost_replica_axis(dist_run):
    for rank, got in enumerate(dist_run(4, _replica_mesh_groups)):
        mesh, inner, pipeline, replica, outer, position, whole, across = got
        assert (
            mesh == "Mesh(replica=2, pp=2, dp=1; canonical 2 x 2)"
            and inner == "Mesh(pp=2, dp=1; canonical 2)"
        )
        base = rank // 2 * 2  # the groups of a cut-out mesh are the world's, this rank's replica fixed
        assert pipeline == replica == [base, base + 1] and outer == [rank % 2, rank % 2 + 2]
        assert position == (rank // 2, 2)  # the data of dp 2: one row set per replica
        assert whole == "Mesh(replica=2, pp=2; canonical 2 x 2)" and across == outer


@pytest.mark.parametrize(
    "inside", ["level1", *(pytest.param(case, marks=pytest.mark.slow) for case in INSIDE if case != "level1")]
)  # fmt: skip
def test_replicas_of_several_ranks_with_identity_outer_step_are_data_parallelism(dist_run, tmp_path, inside):
    # sync_every = 1, inner SGD, outer SGD(lr 1, momentum 0): 2 replicas of dp 2 (optimizer levels 1, 3: states,
    # and parameters, sharded over each replica's own dp ranks) are synchronous dp 4; 2 replicas of pp 2 are
    # synchronous dp 2 x pp 2; likewise with pp 2 or tp 2 besides dp 2 inside each replica (8 ranks)
    replicas, synchronous = INSIDE[inside]
    identity = {"sync": "diloco", "sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, **replicas}
    ranks = synchronous["dp"] * synchronous.get("pp", 1) * synchronous.get("tp", 1)
    runs = {}
    for name, parallel in (("sync", synchronous), ("replicas", identity)):
        case = _sgd(parallel)
        rows = synchronous["dp"] * synchronous.get("microbatches", 1)  # a row per micro-batch and dp rank
        train = {**case["train"], "steps": 4, "workers": ranks, "global_batch": max(4, rows)}
        config = _config(tmp_path, name, case["parallel"], train)
        done = dist_run(ranks, run, config)
        runs[name] = ([r["losses"] for r in done], read_model_tensors(tmp_path / name / "step_000004"))
    (sync_losses, sync_params), (replica_losses, replica_params) = runs["sync"], runs["replicas"]
    # the first half of the ranks is replica 0 (the "replica" axis outermost); each rank reports its replica's
    half = ranks // 2
    assert all(replica_losses[r] == replica_losses[r // half * half] for r in range(ranks))
    means = [(a + b) / 2 for a, b in zip(replica_losses[0], replica_losses[half], strict=True)]
    assert means == pytest.approx(sync_losses[0], rel=TOL, abs=TOL)
    assert replica_params.keys() == sync_params.keys()
    for name, value in sync_params.items():
        torch.testing.assert_close(replica_params[name], value, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.slow  # 4 ranks
def test_pipelined_replicas_meet_only_at_syncs_with_their_stage_bytes(dist_run, tmp_path):
    steps, every = 7, 3
    parallel = {"sync": "diloco", "sync_every": every, "dp": 2, "pp": 2, "microbatches": 2}
    config = _config(tmp_path, "count", parallel, {"steps": steps, "workers": 4})
    done = dist_run(4, _counted_run, config, 2)
    stages = all_stages(config, GPT(config.model.gpt_config()))  # pipeline rank k runs stage k (1f1b)
    for rank, (summary, calls) in enumerate(done):  # rank = replica * 2 + pipeline rank
        stage_bytes = 4 * sum(p.numel() for p in stages[rank % 2].parameters())  # fp32
        during = {step: sizes for step, sizes in calls.items() if 1 <= step <= steps}
        assert during == {s: [stage_bytes] for s in range(every, steps + 1, every)}, (rank, during)
        assert summary["losses"][-1] < summary["losses"][0], summary["losses"]


@pytest.mark.parametrize(
    ("parallel", "match"),
    [
        ({"sync_every": 4}, r"parallel.sync_every = 4 is read only with parallel.sync = 'local_sgd' or 'diloco'"),
        ({"sync": "local_sgd", "outer_lr": 1.0}, r"parallel.outer_lr = 1.0 is read only with parallel.sync = 'diloco'"),
        ({"sync": "diloco", "sync_every": 2, "fragments": 3}, r"parallel.fragments = 3 .* at most"),
        ({"sync": "diloco", "sync_every": 2, "fragment_delay": 2}, r"parallel.fragment_delay = 2 .* less than"),
        ({"sync": "diloco", "outer_momentum": 1.0}, r"parallel.outer_momentum = 1.0 .* \[0, 1\)"),
        ({"sync": "diloco", "optimizer_level": 1}, r"parallel.optimizer_level = 1 with parallel.sync = 'diloco' shards over the data-parallel ranks inside each replica"),
        ({"sync": "diloco", "dp": 4, "replicas": 4, "optimizer_level": 2}, r"parallel.replicas = 4 \(dp = 4\) a replica has one: set parallel.replicas"),
        ({"sync": "diloco", "dp": 4, "replicas": 3}, r"parallel.replicas = 3 must divide parallel.dp = 4: .* \[1, 2, 4\]"),
        ({"sync": "diloco", "replicas": 0}, r"parallel.replicas = 0 is out of range"),
        ({"replicas": 2}, r"parallel.replicas = 2 is read only with parallel.sync = 'local_sgd' or 'diloco'"),
        ({"sync": "diloco", "cp": 2}, r"parallel.cp = 2 with parallel.sync"),
        ({"sync": "diloco", "dp": 4, "replicas": 2, "ep": 2}, r"parallel.ep = 2 with parallel.sync"),
        ({"sync": "local_sgd", "pp": 2, "microbatches": 2, "elastic": True}, r"parallel.pp = 2 with fault.elastic_replicas = true"),
        ({"sync": "local_sgd", "dp": 4, "replicas": 2, "elastic": True}, r"parallel.replicas = 2 with fault.elastic_replicas = true"),
    ],
)  # fmt: skip
def test_bad_sync_settings_name_the_key_and_the_fix(parallel, match):
    fault = {"elastic_replicas": parallel.pop("elastic", False)}
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict({"parallel": parallel, "data": {"seq_len": 32}, "fault": fault})


def test_replicas_of_one_process_each_may_say_so_under_elastic_replicas():
    parallel = {"sync": "local_sgd", "dp": 4, "replicas": 4}  # one process per replica, as replicas = -1
    TrainConfig.from_dict(
        {"parallel": parallel, "data": {"seq_len": 32}, "fault": {"elastic_replicas": True}}
    )


def _metadata(*paths: tuple) -> Metadata:
    return Metadata(state_dict_metadata={}, planner_data={".".join(path): path for path in paths})


def test_a_checkpoint_without_this_ranks_replica_entry_is_refused():
    mine = ("optim", "replicas", "rank_00000")
    assert replica_load_template(_metadata(("model", "w"), mine)) == {"optim": {"replicas": {mine[2]: None}}}
    assert replica_load_template(_metadata(("model", "w"))) == {}  # weights only: start from them
    synchronous = _metadata(("model", "w"), ("optim", "state", "w", "exp_avg"))
    with pytest.raises(CheckpointError, match="saved by synchronous training .* resume with the sync"):
        replica_load_template(synchronous)


def test_a_checkpoint_of_another_number_of_ranks_is_refused():
    # 4 one-process replicas resumed on 1 rank here (on 2 ranks alike): replicas 1-3 would be dropped
    entries = [("optim", "replicas", f"rank_{r:05d}") for r in range(4)]
    with pytest.raises(CheckpointError, match=r"states of 4 ranks; this run has 1: .* resume on the mesh"):
        replica_load_template(_metadata(("model", "w"), *entries))


def _replica(sync: str, **options) -> LocalSGD | DiLoCo:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    kind = LocalSGD if sync == "local_sgd" else DiLoCo
    return kind(net.parameters(), inner, **{"sync_every": 4, **options})


def _saved(optimizer: LocalSGD | DiLoCo, **changes) -> dict:
    return {"optim": {"replicas": {"rank_00000": ({**optimizer.rank_state(), **changes},)}}}


@pytest.mark.parametrize(
    ("saved", "now", "match"),
    [
        (("local_sgd", {}), ("diloco", {}), r"parallel.sync = 'local_sgd' saved, 'diloco' now"),
        (("diloco", {}), ("local_sgd", {}), r"parallel.sync = 'diloco' saved, 'local_sgd' now"),
        (("local_sgd", {}), ("local_sgd", {"sync_every": 2}), r"parallel.sync_every = 4 saved, 2 now"),
        (("diloco", {}), ("diloco", {"outer_kwargs": {"lr": 1.0}}), r"parallel.outer_lr = 0.7 saved, 1.0 now"),
        (("diloco", {}), ("diloco", {"fragments": 2}), r"parallel.fragments = 1 saved, 2 now"),
        (("diloco", {}), ("diloco", {"outer_dtype": torch.bfloat16}), r"parallel.outer_dtype = 'fp32' saved, 'bf16'"),
    ],
)  # fmt: skip
def test_a_replica_entry_of_other_sync_settings_is_refused(saved, now, match):
    entry = _saved(_replica(saved[0], **saved[1]))
    with pytest.raises(CheckpointError, match=match + ".*resume with the settings the checkpoint was saved"):
        load_replica_state(_replica(now[0], **now[1]), entry)


def test_a_replica_entry_of_another_world_size_is_refused_and_a_matching_one_loads():
    saved = _replica("diloco", fragments=2, fragment_delay=1)
    with torch.no_grad():
        saved.params[0].add_(1.0)
    with pytest.raises(CheckpointError, match=r"saved by 4 ranks in 4 replicas; this run has 1 ranks in 1"):
        load_replica_state(
            _replica("diloco", fragments=2, fragment_delay=1), _saved(saved, world_size=4, replicas=4)
        )
    resumed = _replica("diloco", fragments=2, fragment_delay=1)
    load_replica_state(resumed, _saved(saved))
    assert torch.equal(resumed.params[0], saved.params[0])
