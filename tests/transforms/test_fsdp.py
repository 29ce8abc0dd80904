"""FSDP2 (issue 22), on 2 CPU gloo processes: the step reduce-scatters once per optimizer step and trains a
sharded model as DDP trains the unsharded one, the mixed-precision policy, float16 skips agreed across ranks,
and sharded checkpoints that survive kill -9 and resume on another number of processes."""
import errno
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import yaml
from ignite.engine import Engine, Events
from torch.distributed.fsdp import fully_shard
from torch.nn.functional import cross_entropy

from helpers import ROOT, error_lines, free_port, in_group, tiny_config
from ignite_amp import AmpEvents, create_amp_trainer, load_config
from ignite_amp.cli.main import main
from ignite_amp.data.datasets import LockstepBatches
from ignite_amp.errors import CheckpointError, CheckpointWriteError
from ignite_amp.files.checkpoints import load_checkpoint
from ignite_amp.handlers import BestCheckpoint, GradientClipping
from ignite_amp.run.compose import build_run
from ignite_amp.transforms.sharding import block_names, load_full_model_state, shard_model


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train(model, rank, syncs=None):
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32", accumulation_steps=2, micro_batches=2)
    GradientClipping(max_norm=0.5).attach(trainer)
    if syncs is not None:  # record what the step asks of FSDP before each backward
        ask = model.set_requires_gradient_sync
        model.set_requires_gradient_sync = lambda value, **kw: (syncs.append(value), ask(value, **kw))
    g = torch.Generator().manual_seed(rank)
    trainer.run([(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(4)])


def train_items(model, rank):
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32", accumulation_steps=2, micro_batches=2,
                                 num_items=lambda x, y: (y != -100).sum())
    g, batches = torch.Generator().manual_seed(rank), []
    for _ in range(4):
        y = torch.randint(0, 4, (6,), generator=g)
        y[torch.rand(6, generator=g) < 0.4] = -100  # padding, a different count on each rank
        batches.append((torch.randn(6, 8, generator=g), y))
    trainer.run(batches)


def _compare(rank, out):
    sharded, syncs = build(), []
    fully_shard(sharded)
    train(sharded, rank, syncs)
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    plain = build()
    train(torch.nn.parallel.DistributedDataParallel(plain), rank)
    diff = max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in plain.state_dict().items())
    # A padded token mean (num_items): the item counts are summed over the ranks as under DDP.
    sharded, plain = shard_model(build(), "float32", device="cpu"), build()
    train_items(sharded, rank)
    train_items(torch.nn.parallel.DistributedDataParallel(plain), rank)
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    items = max(float((full[k] - v).abs().max() / v.abs().max()) for k, v in plain.state_dict().items())
    torch.save({"diff": diff, "syncs": syncs, "items": items}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_trains_like_ddp_with_one_reduce_scatter_per_optimizer_step_and_token_means(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _compare, str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["diff"] < 1e-6, result["diff"]  # float32: the same sums in another order
        assert result["items"] < 1e-6, result["items"]
        # 4 batches = 2 optimizer steps of 2 iterations x 2 micro-batches: only each step's last backward syncs.
        assert result["syncs"] == [False, False, False, True] * 2


# -- sharding with the mixed-precision policy -------------------------------------------------------------------
def build_blocks():
    """A model with repeated blocks (an inner Sequential of three Linear layers) and a BatchNorm."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)]),
                               torch.nn.Linear(16, 4))


def test_the_repeated_blocks_are_sharded_one_by_one():
    assert block_names(build_blocks()) == ["2.0", "2.1", "2.2"]
    assert block_names(build_blocks(), ["Linear"]) == ["0", "2.0", "2.1", "2.2", "3"]
    with pytest.raises(ValueError, match="blocks: the model has no submodule of class 'Block'"):
        block_names(build_blocks(), ["Block"])


def _policy_vs_ddp(rank, out):
    sharded = shard_model(build_blocks(), "bfloat16", device="cpu")
    dtypes = {p.dtype for m in sharded.modules() for p in m.parameters(recurse=False)}
    run_bf16(sharded, rank)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
    plain = build_blocks()
    run_bf16(torch.nn.parallel.DistributedDataParallel(plain), rank)
    diff = max(float((full[k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
               for k, v in plain.state_dict().items() if v.is_floating_point())
    torch.save({"diff": diff, "dtypes": dtypes, "bn": str(sharded[1].weight.dtype)},
               os.path.join(out, f"rank{rank}.pt"))


def run_bf16(model, rank):
    trainer = create_amp_trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cross_entropy, device="cpu",
                                 dtype="bfloat16", accumulation_steps=2)
    g = torch.Generator().manual_seed(rank)
    trainer.run([(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(8)])


@pytest.mark.slow
@pytest.mark.distributed
def test_bfloat16_parameters_by_the_policy_train_like_ddp_under_autocast(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _policy_vs_ddp, str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # Between the optimizer steps the shards stay float32 (the policy casts them for each forward), and
        # autocast runs each matmul in bfloat16 in both: the gradients differ by bfloat16 rounding (the policy
        # keeps the weight gradient in bfloat16 until the float32 reduce-scatter, autocast casts it back at once),
        # so after 4 AdamW steps of lr 1e-2 they agree to a few bfloat16 ulps (2^-8 = 0.4% each).
        assert result["diff"] < 0.02, result["diff"]
        assert result["dtypes"] == {torch.float32} and result["bn"] == "torch.float32"


def _float16_skips(rank, out):
    model = shard_model(build(), "float16", device="cpu")
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float16")
    step, skipped = trainer.amp_step, []
    trainer.add_event_handler(AmpEvents.STEP_SKIPPED, lambda e: skipped.append(e.state.iteration))
    unscale = step.scaler.unscale_

    def overflow_on_rank_0_only(optimizer):  # an inf in one element of rank 0's shard, at iteration 2
        if rank == 0 and trainer.state.iteration == 2:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        unscale(optimizer)

    step.scaler.unscale_ = overflow_on_rank_0_only
    g = torch.Generator().manual_seed(rank)
    trainer.run([(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)])
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.save({"skipped": skipped, "scale": step.scaler.get_scale(), "weights": full},
               os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_float16_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _float16_skips, str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for result in results:
        assert result["skipped"] == [2]
        assert result["scale"] == 2.0 ** 16 / 2  # both scalers backed off once, from the default 2^16
    assert all(torch.equal(results[0]["weights"][k], results[1]["weights"][k]) for k in results[0]["weights"])


# -- the config path: sharded checkpoints, kill -9, resume on another number of processes ----------------------------
def fsdp_config(tmp_path, name, epochs=4, nproc=2):
    cfg = tiny_config(tmp_path, name=name, output_dir=str(tmp_path / name), train={"epochs": epochs},
                      data={"train_size": 256, "val_size": 33, "batch_size": 32},
                      amp={"dtype": "bfloat16"}, distributed={"nproc_per_node": nproc, "strategy": "fsdp"})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), cfg


def cli(*args):
    return [sys.executable, "-m", "ignite_amp", *args]


def last(run_dir):
    ckpts = os.path.join(run_dir, "checkpoints")
    names = [f for f in os.listdir(ckpts) if f.startswith("last_")] if os.path.isdir(ckpts) else []
    return os.path.join(ckpts, names[0]) if names else None


@pytest.mark.timeout(1800)
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_kill_9_after_a_sharded_checkpoint_resumes_to_the_uninterrupted_weights(tmp_path, forks):
    whole, whole_cfg = fsdp_config(tmp_path, "whole")
    done = forks.run(cli("train", whole)[1:], ROOT)  # forked (helpers.forks); the run killed below starts afresh
    assert done.returncode == 0, done.stderr
    assert "FSDP2: the model in 2 shards" in done.stdout

    path, cfg = fsdp_config(tmp_path, "killed")
    proc = subprocess.Popen(cli("train", path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and last(cfg["output_dir"]) is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-epoch
    proc.communicate(timeout=60)
    first = last(cfg["output_dir"])
    assert first is not None and os.path.isdir(first) and not first.endswith("_4.dcp")

    again = forks.run(cli("train", path)[1:], ROOT)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {first}" in again.stdout
    expected = load_full_model_state(last(whole_cfg["output_dir"]))
    got = load_full_model_state(last(cfg["output_dir"]))
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    # The same checkpoint on one process: DCP reshards it into the unsharded model, optimizer state included.
    one = load_config(path, ["distributed.nproc_per_node=1", "train.epochs=5"])
    run = build_run(one)
    try:
        assert run.resumed_from == last(cfg["output_dir"])
        assert all(torch.equal(v, got[k]) for k, v in run.model.state_dict().items())
        assert run.optimizer.state_dict()["state"][0]["step"] == 4 * 8  # 4 epochs of 8 iterations
        result = run.train()
    finally:
        run.close()
    assert [r["epoch"] for r in result["history"]] == [5]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sharded_checkpoint_refuses_a_change_of_strategy_in_one_line(tmp_path, capsys):
    path, cfg = fsdp_config(tmp_path, "strategy", epochs=1, nproc=1)
    assert main(["train", path]) == 0
    assert os.path.isdir(last(cfg["output_dir"]))
    capsys.readouterr()
    named = f"handlers.checkpoint.resume={last(cfg['output_dir'])}"  # auto over a finished run would start anew
    assert main(["train", path, "--set", "distributed.strategy=ddp", "--set", "train.epochs=2", "--set", named]) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "distributed.strategy fsdp -> ddp cannot change under a resume" in err[0], err
    assert main(["train", path, "--set", "amp.channels_last=true"]) == 2
    assert "amp.channels_last: not with distributed.strategy fsdp" in capsys.readouterr().err


@pytest.mark.parametrize("n, world, batch", [(33, 2, 16), (32, 2, 16), (101, 4, 8), (7, 3, 1), (5, 2, 100)])
def test_lockstep_validation_batches_are_as_many_on_every_rank_and_cover_each_sample_once(n, world, batch):
    shards = [list(LockstepBatches(list(range(n)), batch, num_replicas=world, rank=r)) for r in range(world)]
    assert len({len(batches) for batches in shards}) == 1  # as many forwards on every rank
    assert sorted(i for batches in shards for b in batches for i in b) == list(range(n))
    assert all(0 < len(b) <= batch + 1 for batches in shards for b in batches)


@pytest.mark.timeout(1800)
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_on_two_gpus_with_nccl_trains_and_resumes(tmp_path):
    path, cfg = fsdp_config(tmp_path, "gpu", epochs=2)
    cfg.update(device="cuda", distributed=dict(cfg["distributed"], backend="nccl"))
    open(path, "w").write(yaml.safe_dump(cfg))
    done = subprocess.run(cli("train", path), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "2 processes (nccl, FSDP2: the model in 2 shards), cuda" in done.stdout
    more = subprocess.run(cli("train", path, "--set", "train.epochs=3"), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stderr
    assert last(cfg["output_dir"]).endswith("last_checkpoint_3.dcp")


def _disk_full_on_rank_0(rank, out):
    model = shard_model(build(), "float32", device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_amp_trainer(model, optimizer, cross_entropy, device="cpu", dtype="float32")
    evaluator, scores = Engine(lambda e, b: None), iter([0.5, 0.9])
    evaluator.add_event_handler(Events.COMPLETED, lambda e: e.state.metrics.update(accuracy=next(scores)))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run([0]))
    ckpts = os.path.join(out, "ckpts")
    BestCheckpoint(ckpts, {"model": model, "optimizer": optimizer, "trainer": trainer}, n_saved=1).attach(
        trainer, evaluator)
    save = torch.save

    def full_disk(obj, f, **kwargs):  # rank 0's state.pt of epoch 2 finds the disk full
        if rank == 0 and trainer.state.epoch == 2 and getattr(f, "name", "").endswith("state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, **kwargs)

    torch.save = full_disk
    message = None
    g = torch.Generator().manual_seed(rank)
    try:
        trainer.run([(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))] * 2, max_epochs=2)
    except CheckpointWriteError as exc:
        message = str(exc)
    torch.save = save
    torch.save({"message": message, "files": sorted(os.listdir(ckpts))}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_disk_on_one_rank_stops_every_rank_in_one_line_and_keeps_the_sharded_checkpoints(tmp_path):
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _disk_full_on_rank_0, str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert "no space left on device; the previous checkpoints are kept" in result["message"]
        assert result["files"] == ["best_checkpoint_1_accuracy=0.5000.dcp", "last_checkpoint_1.dcp"]  # no temp dir
    # From Python on one process: BestCheckpoint resumes the sharded checkpoint into the unsharded model.
    model, trainer = build(), Engine(lambda e, b: None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = BestCheckpoint(tmp_path / "ckpts", {"model": model, "optimizer": optimizer, "trainer": trainer},
                                n_saved=1, sharded=True)
    checkpoint.attach(trainer, Engine(lambda e, b: None))
    assert checkpoint.resume().endswith("last_checkpoint_1.dcp") and trainer.state.epoch == 1
    saved = load_full_model_state(str(tmp_path / "ckpts" / "last_checkpoint_1.dcp"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(saved["0.weight"], build().state_dict()["0.weight"])  # trained, not the initial weights


def test_float32_modules_and_blocks_are_sharded_innermost_first_with_their_own_precision():
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        # (fp32_modules, blocks, expected weight dtype inside model[2][0]'s forward)
        for fp32, blocks, inner in ((["1"], None, torch.bfloat16),  # a BatchNorm named too: sharded once
                                    (["2"], None, torch.float32),  # a parent of the blocks: its blocks in float32
                                    (["3"], ["Linear", "BatchNorm1d"], torch.bfloat16)):  # classes before renaming
            model, seen = shard_model(build_blocks(), "bfloat16", blocks=blocks, fp32_modules=fp32, device="cpu"), []
            model[2][0].register_forward_pre_hook(lambda m, args, seen=seen: seen.append(m.weight.dtype))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(4, 8)).float().sum().backward()
            assert seen == [inner], (fp32, blocks, seen)
            assert all(p.grad is not None and p.dtype == torch.float32 for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_truncated_shard_is_skipped_for_the_previous_checkpoint_and_named_when_asked_for(tmp_path):
    path, cfg = fsdp_config(tmp_path, "cut", epochs=2, nproc=1)
    assert main(["train", path]) == 0
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    shard = os.path.join(ckpts, "last_checkpoint_2.dcp", "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match=r"last_checkpoint_2.dcp: shard __0_0.distcp is truncated"):
        load_checkpoint(os.path.dirname(shard))
    found, _ = BestCheckpoint.find_resumable(ckpts)
    assert os.path.basename(found).startswith("best_checkpoint_2_")  # the newest that loads
    assert os.path.isdir(os.path.join(ckpts, "last_checkpoint_2.dcp.unreadable"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_shard_overwritten_with_same_size_bytes_falls_back_and_is_named_when_asked_for(tmp_path, capsys):
    """Case 32.12: the sizes are right, so only reading the shard tells; every rerun stopped in the same line."""
    path, cfg = fsdp_config(tmp_path, "noise", epochs=2, nproc=1)
    assert main(["train", path]) == 0
    ckpts = os.path.join(cfg["output_dir"], "checkpoints")
    bad = os.path.join(ckpts, "last_checkpoint_2.dcp")
    shard = os.path.join(bad, "__0_0.distcp")
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (os.path.getsize(shard),), dtype=torch.uint8, generator=g)
    with open(shard, "r+b") as f:
        f.write(noise.numpy().tobytes())
    capsys.readouterr()
    assert main(["train", path, "--set", f"handlers.checkpoint.resume={bad}", "--set", "train.epochs=3"]) == 2
    # Which error the bytes raise depends on the bytes (UnpicklingError, IndexError...): the line names it.
    err = error_lines(capsys.readouterr().err)
    why = re.fullmatch(rf"ignite-amp: error: checkpoint {re.escape(bad)}: a shard does not read back \((\w+)\)",
                       err[-1])
    assert why, err
    assert main(["train", path, "--set", "train.epochs=3"]) == 0
    captured = capsys.readouterr()
    assert f"skipped {bad} (a shard does not read back ({why.group(1)})): resuming from the older " \
           f"best_checkpoint_2_" in captured.err
    assert re.search(r"resumed from \S+best_checkpoint_2_\S+ at epoch 2", captured.out)
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("last_")) == [
        "last_checkpoint_2.dcp.unreadable", "last_checkpoint_3.dcp"]


def test_tied_weights_across_blocks_are_refused_naming_the_rule():
    """Case 32.11: FSDP gathers and frees each block's parameters on its own; a weight two blocks share broke
    inside a spawned rank, after the run had started."""
    from ignite_amp.transforms.sharding import check_shardable

    model = build_blocks()
    model[2][2].weight = model[2][0].weight
    with pytest.raises(ValueError, match=r"blocks: block '2.0' and block '2.2' share a parameter \(2.0.weight is "
                                         r"2.2.weight\): FSDP shards each block on its own, so tied weights"):
        check_shardable(model)
    assert check_shardable(build_blocks()) == ["2.0", "2.1", "2.2"]
    outer = build_blocks()
    outer[2][0].bias = outer[3].bias = torch.nn.Parameter(torch.zeros(16))
    with pytest.raises(ValueError, match=r"block '2.0' and the model outside the blocks share a parameter"):
        check_shardable(outer)


@pytest.mark.slow
@pytest.mark.distributed
def test_blocks_naming_a_missing_class_is_one_line_on_one_process_too(tmp_path, capsys):
    """Case 32.13: caught by shard_model on 2 processes, but one process (which saves sharded checkpoints
    all the same) never sharded, so never checked."""
    path, cfg = fsdp_config(tmp_path, "one", epochs=1, nproc=1)
    cfg["distributed"]["blocks"] = ["Nope"]
    open(path, "w").write(yaml.safe_dump(cfg))
    assert main(["train", path]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: distributed.blocks: the model has no submodule of class 'Nope'"]
