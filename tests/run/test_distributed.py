"""Data-parallel training on CPU: two gloo processes against one process over the same global batch."""
import copy
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import yaml

from helpers import ROOT, free_port, in_group
from helpers.forks import Forks, Ran
from ignite_amp import load_config, train_from_config
from ignite_amp.data.datasets import EvenShardSampler
from ignite_amp.launcher import launch

TESTS = os.path.join(ROOT, "tests")  # where helpers/ is: the children import their models from it

# float32, a model without BatchNorm (per-rank batch statistics would differ from the global
# batch's), no augmentation: two ranks of 16 must train exactly like one process of 32.
BASE = {
    "name": "ddp",
    "device": "cpu",
    "amp": {"dtype": "float32"},
    "data": {"name": "shapes", "batch_size": 32, "num_workers": 0, "train_size": 256, "val_size": 65,
             "image_size": 16},
    "model": {"name": "helpers:oom_cnn", "num_classes": 10, "kwargs": {"limit": 1000}},
    "optimizer": {"name": "AdamW", "lr": 3e-3},
    "scheduler": {"name": "onecycle"},
    "train": {"epochs": 2},
}


def config(output_dir, **sections) -> dict:
    cfg = copy.deepcopy(BASE)
    for key, value in sections.items():
        cfg[key] = dict(cfg.get(key, {}), **value) if isinstance(value, dict) else value
    cfg["output_dir"] = str(output_dir)
    return cfg


ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
def cli(cfg: dict, tmp_path, nproc: int = 2, torchrun: bool = False, forks: Optional[Forks] = None) -> Ran:
    """``ignite-amp train``: ``nproc`` processes spawned from the config, the command in a process forked from
    ``forks`` (the suite's fork server, ``helpers.forks``; the spawned ranks start afresh), or by torchrun in a
    fresh interpreter."""
    path = tmp_path / f"{os.path.basename(cfg['output_dir'])}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if torchrun:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", "ignite_amp", "train", str(path)]
        proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=ENV, timeout=300)
        return Ran(proc.returncode, proc.stdout, proc.stderr)
    if forks is None:
        raise TypeError("cli: a launch without torchrun forks from the suite's fork server: pass forks=")
    return forks.run(["-m", "ignite_amp", "train", str(path), "--set", f"distributed.nproc_per_node={nproc}"], ROOT,
                     env=ENV, limit=300)


def one_process(cfg: dict) -> dict:
    lines = []
    result = train_from_config(cfg, print_fn=lines.append)
    result["lines"] = lines
    return result


def weights(output_dir) -> dict:
    folder = os.path.join(output_dir, "checkpoints")
    last = [n for n in os.listdir(folder) if n.startswith("last_")]
    assert len(last) == 1, last
    return torch.load(os.path.join(folder, last[0]), weights_only=True)


def assert_same_weights(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=key)


def epoch_lines(text) -> list:
    """Epoch lines without the timing columns."""
    lines = text if isinstance(text, list) else text.splitlines()
    return [re.sub(r"\s+[\d.]+s$", "", line) for line in lines if re.match(r"epoch \d+/\d+", line)]


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_two_processes_train_like_one_and_only_rank_0_writes(tmp_path, forks):
    cfg = config(tmp_path / "two", handlers={"profiler": {"enabled": True, "wait": 1, "warmup": 1, "active": 2}})
    two = cli(cfg, tmp_path, forks=forks)
    assert two.returncode == 0, two.stderr
    ref = one_process(dict(cfg, output_dir=str(tmp_path / "one")))

    # Same weights, same global train loss and the same validation metrics over all 65 samples
    # (sharded 33 + 32 without padding), printed once.
    assert_same_weights(weights(tmp_path / "one")["model"], weights(tmp_path / "two")["model"])
    assert epoch_lines(two.stdout) == epoch_lines(ref["lines"]) and len(epoch_lines(two.stdout)) == 2
    assert "training ddp on 2 processes (gloo), cpu" in two.stdout
    assert two.stdout.count("done: val accuracy") == 1
    assert "Traceback" not in two.stderr

    # Only rank 0 wrote: the same files as one process, and every TensorBoard/profiler file from one pid.
    def listing(run):
        return sorted(os.path.relpath(os.path.join(d, f), run) for d, _, fs in os.walk(run) for f in fs)

    def tensorboard(f):  # event files in output_dir and its train/ and val/ runs, the profiler's under profiler/
        return os.path.basename(f).startswith("events.out.tfevents") or f.startswith("profiler" + os.sep)

    files = listing(tmp_path / "two")
    assert [f for f in files if not tensorboard(f)] == [f for f in listing(tmp_path / "one") if not tensorboard(f)]
    logs = [f for f in files if tensorboard(f)]
    pids = {re.search(r"\.(\d+)\.\d+$", f).group(1) for f in logs if "events.out.tfevents" in f}
    assert len(pids) == 1 and len(logs) == 6, logs  # four event files (run, train, val, profiler), a trace, a table
    assert sum(os.path.basename(f).startswith("trace_iterations_") for f in logs) == 1

    # Rank 0's memory, and the largest rank's (every rank reads its own; one all-reduce per log).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "two" / "train"))
    acc.Reload()
    own, largest = ([e.value for e in acc.Scalars(t)] for t in ("memory/rss_mb", "memory/max_rank_rss_mb"))
    assert len(largest) == len(own) > 0 and all(m >= o for m, o in zip(largest, own, strict=True))
    assert "the largest rank's" in two.stdout


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_torchrun_with_accumulation_and_micro_batches_matches_one_process(tmp_path):
    """Launched by torchrun. Without OOM backoff DDP overlaps its all-reduce with the last backward
    of each optimizer step, the other chunks under no_sync."""
    cfg = config(tmp_path / "two", amp={"accumulation_steps": 2, "micro_batches": 2},
                 handlers={"oom_backoff": {"enabled": False}})
    two = cli(cfg, tmp_path, torchrun=True)
    assert two.returncode == 0, two.stderr
    assert "training ddp on 2 processes (gloo), cpu" in two.stdout and two.stdout.count("done: val accuracy") == 1
    one_process(dict(cfg, output_dir=str(tmp_path / "one")))
    assert_same_weights(weights(tmp_path / "one")["model"], weights(tmp_path / "two")["model"])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_out_of_memory_on_one_rank_backs_off_every_rank(tmp_path, forks):
    cfg = config(tmp_path / "two", model={"name": "helpers:oom_on_rank", "kwargs": {"limit": 8, "rank": 1}})
    two = cli(cfg, tmp_path, forks=forks)
    assert two.returncode == 0, two.stderr
    saved = weights(tmp_path / "two")
    # Rank 1 ran out of memory at 16 samples; rank 0 (whose state is saved) backed off with it.
    assert saved["oom_backoff"]["events"] == 1 and saved["amp_step"]["micro_batches"] == 2
    assert "out of memory at micro-batch size 16 on cpu (or another rank's)" in two.stderr
    # And no sample was lost or doubled: the same weights as one process that never ran out.
    one_process(dict(cfg, output_dir=str(tmp_path / "one"), model=BASE["model"]))
    assert_same_weights(weights(tmp_path / "one")["model"], saved["model"])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_out_of_memory_in_the_first_forward_of_a_batchnorm_model_does_not_hang(tmp_path, forks):
    """DDP would broadcast buffers at the start of a forward: the retrying rank would call it once
    more than the others. The step turns that off and the evaluator sends rank 0's buffers instead."""
    cfg = config(tmp_path / "bn", model={"name": "helpers:oom_on_rank", "kwargs": {"limit": 8, "norm": True}},
                 train={"epochs": 1})
    out = cli(cfg, tmp_path, forks=forks)
    assert out.returncode == 0, out.stderr
    assert weights(tmp_path / "bn")["amp_step"]["micro_batches"] == 2


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_resume_across_process_counts(tmp_path, forks):
    """Two processes then one, and one then two, end where one uninterrupted process does."""
    cfg = config(tmp_path / "ref", scheduler={"name": "none"})
    one_process(cfg)
    reference = weights(tmp_path / "ref")

    first = dict(cfg, output_dir=str(tmp_path / "two_then_one"), train={"epochs": 1})
    assert cli(first, tmp_path, forks=forks).returncode == 0
    resumed = one_process(dict(first, train={"epochs": 2}))
    assert any("resumed from" in line for line in resumed["lines"])
    assert_same_weights(reference["model"], weights(tmp_path / "two_then_one")["model"])

    first = dict(cfg, output_dir=str(tmp_path / "one_then_two"), train={"epochs": 1})
    one_process(first)
    second = cli(dict(first, train={"epochs": 2}), tmp_path, forks=forks)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    final = weights(tmp_path / "one_then_two")
    assert_same_weights(reference["model"], final["model"])
    assert final["trainer"]["iteration"] == reference["trainer"]["iteration"] == 16


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_rank_error_is_one_line_in_the_parent(tmp_path, forks):
    cfg = config(tmp_path / "odd", data={"batch_size": 33})
    out = cli(cfg, tmp_path, forks=forks)
    assert out.returncode == 2
    assert out.stderr == ("ignite-amp: error: data.batch_size: 33 is the global batch and should divide "
                          "evenly over 2 processes\n")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_nccl_without_cuda_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from ignite_amp.cli.main import main

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path / "x", distributed={"backend": "nccl", "nproc_per_node": 2})))
    assert main(["train", str(path)]) == 2


def _search_on_rank(limits: dict) -> int:
    from helpers import OOMAbove, mlp  # noqa: F401  (stand-in: a model that runs out of memory above a size)
    from ignite_amp.batch_search import find_batch_size

    model = OOMAbove(limit=limits[dist.get_rank()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def make_batch(n):
        return torch.randn(n, 5), torch.randint(0, 3, (n,))

    return find_batch_size(model, optimizer, torch.nn.functional.cross_entropy, make_batch, device="cpu",
                           dtype="float32", start=8, max_size=256, margin=0.0).batch_size


@pytest.mark.slow
@pytest.mark.distributed
def test_find_batch_size_takes_the_smallest_rank(tmp_path):
    cfg = load_config({"device": "cpu", "distributed": {"nproc_per_node": 2}})
    # Rank 0 holds 200 samples, rank 1 only 50: rank 0 answers with rank 1's size.
    assert launch(cfg, _search_on_rank, {0: 200, 1: 50}) == 50


def test_even_shard_sampler_covers_every_sample_once():
    data = list(range(10))
    shards = [list(EvenShardSampler(data, num_replicas=3, rank=r)) for r in range(3)]
    assert sorted(sum(shards, [])) == data
    assert [len(EvenShardSampler(data, num_replicas=3, rank=r)) for r in range(3)] == [4, 3, 3]


def test_ddp_all_reduces_once_per_optimizer_step(tmp_path, monkeypatch):
    """Accumulation and micro-batches run under no_sync: one gradient all-reduce per optimizer step."""
    import ignite.distributed as idist

    monkeypatch.setenv("LOCAL_RANK", "0")
    from helpers import mlp
    from ignite_amp import create_amp_trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(mlp())
        calls = []

        def counting_hook(state, bucket):
            calls.append(bucket.index())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        model.register_comm_hook(None, counting_hook)
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     torch.nn.functional.cross_entropy, device="cpu", dtype="float32",
                                     accumulation_steps=2, micro_batches=3)
        batches = [(torch.randn(6, 5), torch.randint(0, 3, (6,))) for _ in range(4)]
        trainer.run(batches, max_epochs=1)
        # 4 iterations x 3 micro-batches = 12 backward passes, 2 optimizer steps: 2 all-reduces.
        assert len(calls) == 2
    finally:
        idist.finalize()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.gpu
def test_torchrun_with_one_gpu_process_trains_on_the_gpu_unwrapped(tmp_path):
    """One process under torchrun: no DDP wrapper, the single-GPU path, the same weights as a plain run."""
    cfg = config(tmp_path / "tr", device="cuda", handlers={"oom_backoff": {"enabled": False}})
    out = cli(cfg, tmp_path, nproc=1, torchrun=True)
    assert out.returncode == 0, out.stderr
    assert "training ddp on cuda:0" in out.stdout
    one_process(dict(cfg, output_dir=str(tmp_path / "plain")))
    # cuDNN may pick other algorithms in another process: looser than on CPU
    assert_same_weights(weights(tmp_path / "plain")["model"], weights(tmp_path / "tr")["model"], 1e-3, 1e-4)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_on_two_gpus_trains_like_one_and_backs_off_together(tmp_path, forks):
    cfg = config(tmp_path / "two", device="cuda",
                 model={"name": "helpers:oom_on_rank", "kwargs": {"limit": 8, "rank": 1}})
    two = cli(cfg, tmp_path, forks=forks)
    assert two.returncode == 0, two.stderr
    assert "training ddp on 2 processes (nccl), cuda" in two.stdout
    saved = weights(tmp_path / "two")
    assert saved["amp_step"]["micro_batches"] == 2
    one_process(dict(cfg, output_dir=str(tmp_path / "one"), model=BASE["model"]))
    assert_same_weights(weights(tmp_path / "one")["model"], saved["model"], 1e-3, 1e-4)  # cuDNN: looser


@pytest.mark.slow
@pytest.mark.subprocess
def test_cpu_only_hides_the_gpus_from_cpu_ranks_and_then_restores(monkeypatch):
    """Ignite pins rank N to cuda:N whenever CUDA is visible, gloo included: CPU ranks must not see CUDA."""
    from ignite_amp.launcher import cpu_only

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with cpu_only():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=120)
        assert probe.stdout.strip() == "False"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    with cpu_only(enabled=False):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with cpu_only():
        pass
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # a torchrun rank is this process: it stays on the CPU


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_spawned_ranks_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launching process must not leave its ranks training (holding the lock, writing).

    Started as a shell script's background job (``ignite-amp train ... &``), SIGINT is ignored, and
    torch's own parent-death signal, SIGINT, then does nothing."""
    (tmp_path / "orphans.py").write_text(
        "import os, sys, time\n"
        "import ignite.distributed as idist\n"
        "from ignite_amp.launcher import launch\n"
        "def work(folder):\n"
        "    open(os.path.join(folder, f'rank{idist.get_rank()}.pid'), 'w').write(str(os.getpid()))\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    launch({'device': 'cpu', 'distributed': {'nproc_per_node': 2, 'backend': 'gloo'}}, work, sys.argv[1])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "orphans.py"), str(tmp_path)], env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        assert len(pids) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)]
    finally:
        launcher.kill()
        for p in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(p.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False


def _choose_non_ascii(rank, out):
    import ignite.distributed as idist

    from ignite_amp.core.collectives import broadcast_text
    from ignite_amp.run.resume import choose_checkpoint

    cfg = load_config({"output_dir": os.path.join(out, "runü"), "handlers": {"checkpoint": {
        "resume": os.path.join(out, "runü", "checkpoints", "last_checkpoint_1.pt")}}})
    path, state = choose_checkpoint(cfg, idist.get_rank() == 0, print)
    texts = [broadcast_text(t if rank == 0 else "") for t in ("😀 €ü", "", "ascii")]
    torch.save({"path": path, "epoch": state["trainer"]["epoch"], "texts": texts}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_non_ascii_path_reaches_every_rank_whole(tmp_path):
    """Case 32.1: rank 0's chosen checkpoint went to the other ranks in a buffer sized in characters, filled with
    UTF-8 bytes ('.../runü/.../last_checkpoint_1.pM')."""
    ckpt = tmp_path / "runü" / "checkpoints" / "last_checkpoint_1.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"trainer": {"epoch": 1}, "config": {"value": {}}}, ckpt)
    torch.multiprocessing.spawn(in_group, args=(2, free_port(), _choose_non_ascii, str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result == {"path": str(ckpt), "epoch": 1, "texts": ["😀 €ü", "", "ascii"]}, rank


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_rank_s_internal_error_has_its_cause_in_the_one_line(tmp_path):
    """Case 32.11: the line ended at "rank 0 of 2 failed:", the cause only in train.log."""
    from ignite_amp.cli.failures import describe
    from ignite_amp.launcher import _collect, _post

    try:
        raise KeyError("model.3.weight")
    except KeyError as exc:
        import traceback

        _post(str(tmp_path), 1, ("error", exc, traceback.format_exc()))
    with pytest.raises(RuntimeError) as raised:
        _collect(str(tmp_path), 2)
    assert "Traceback" in str(raised.value)  # kept for train.log and --debug
    assert describe(raised.value)[1].startswith(
        "ignite-amp: internal error: RuntimeError: rank 1 of 2 failed: KeyError: 'model.3.weight' (")



@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_out_of_memory_on_one_rank_is_a_stop_with_what_to_change(tmp_path, monkeypatch):
    """Issue 39: "internal error: RuntimeError: rank 1 of 2 failed: OutOfMemoryError", no advice (an FSDP2
    run cannot retry a batch: no OOMBackoff on several processes)."""
    import ignite_amp.cli.failures as cli
    from ignite_amp.launcher import _collect, _post

    _post(str(tmp_path), 1, ("error", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                             "Traceback (most recent call last):\n..."))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _collect(str(tmp_path), 2)
    assert "Traceback" in str(raised.value)  # kept for train.log and --debug
    monkeypatch.setattr(cli, "state", {})
    assert cli.describe(raised.value) == (1, "ignite-amp: stopped: out of memory (rank 1 of 2: CUDA out of memory. "
                                             "Tried to allocate 2.00 GiB); lower data.batch_size, or raise "
                                             "amp.micro_batches (the same batch in smaller chunks), and run it again")
    (tmp_path / "checkpoints" / "last_checkpoint_1.pt").parent.mkdir()
    (tmp_path / "checkpoints" / "last_checkpoint_1.pt").write_bytes(b"")
    monkeypatch.setattr(cli, "state", {"checkpoints": str(tmp_path / "checkpoints")})
    assert cli.describe(raised.value)[1].endswith(  # the batch size may not change on a resume under a schedule
        "; the last checkpoint is intact: run the same command with --set amp.micro_batches=N (the same batch in N "
        "smaller chunks) to resume")

def _lock_holder(output_dir):
    import ignite.distributed as idist

    from ignite_amp.files.run_directory import RunLock

    if idist.get_rank() != 0:  # rank 0 holds the run directory (RunFiles)
        return None
    lock = RunLock(output_dir).acquire()
    try:
        return open(lock.path).read()
    finally:
        lock.release()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_busy_output_dir_names_the_command_the_user_started_not_a_rank(tmp_path):
    """Case 32.14: spawned rank 0 wrote its own PID into the lock, which the user never saw."""
    cfg = load_config(config(tmp_path / "busy"), ["distributed.nproc_per_node=2"])
    os.makedirs(cfg.output_dir)
    assert launch(cfg, _lock_holder, cfg.output_dir) == str(os.getpid())
    assert "IGNITE_AMP_COMMAND_PID" not in os.environ


def _kill_rank_1(folder):
    import ignite.distributed as idist

    open(os.path.join(folder, f"rank{idist.get_rank()}.pid"), "w").write(str(os.getpid()))
    if idist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    idist.barrier()  # rank 0 waits: its connection to rank 1 closes, or torch stops it
    time.sleep(60)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_a_killed_rank_is_named_with_the_checkpoint_kept_and_how_to_resume(tmp_path, monkeypatch):
    """Case 32.9: "the 2 training processes ended without a result (killed?)", and nothing in train.log."""
    import ignite_amp.cli.failures as cli
    from ignite_amp.errors import RankDiedError

    with pytest.raises(RankDiedError) as raised:
        launch({"device": "cpu", "distributed": {"nproc_per_node": 2, "backend": "gloo"}}, _kill_rank_1, str(tmp_path))
    pid = (tmp_path / "rank1.pid").read_text()
    (tmp_path / "checkpoints" / "last_checkpoint_1.dcp").mkdir(parents=True)
    (tmp_path / "train.log").write_text("")
    monkeypatch.setattr(cli, "state", {"checkpoints": str(tmp_path / "checkpoints"),
                                       "log": str(tmp_path / "train.log")})
    code, line = cli.describe(raised.value)
    assert (code, line) == (1, f"ignite-amp: stopped: rank 1 of 2 (PID {pid}) was killed by SIGKILL (out of memory, "
                               f"or a kill), and the other ranks were stopped; the last checkpoint is intact: run "
                               f"the same command to resume")
    cli._log_rank_death(raised.value, line)
    assert (tmp_path / "train.log").read_text() == line + "\n"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_restart_reads_only_its_own_attempt_s_keys_in_torchrun_s_store(monkeypatch):
    """torchrun serves one store to all its restarts: the rendezvous keeps each attempt's keys apart."""
    from ignite_amp.launcher import _restart_rendezvous

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # torchrun's agent's store
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "RANK": "0", "WORLD_SIZE": "1",
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    first, rank, world_size = next(_restart_rendezvous("ignite-amp-env://"))
    first.set("rank_0", "the address of a rank killed since")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second, _, _ = next(_restart_rendezvous("ignite-amp-env://"))
    assert (rank, world_size) == (0, 1) and first.check(["rank_0"]) and not second.check(["rank_0"])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.distributed
def test_torchrun_max_restarts_resumes_on_the_first_restart_after_a_kill_9(tmp_path):
    """Issue 39: after `kill -9` of rank 0 the first restart died in "Gloo connectFullMesh failed ... Connection
    refused" (the new rank 1 read the killed rank's address from torchrun's store), and only the second resumed."""
    cfg = config(tmp_path / "run", train={"epochs": 4}, scheduler={"name": "none"},
                 data=dict(BASE["data"], train_size=512, val_size=32))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "--max-restarts=1", "-m", "ignite_amp", "train", str(path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "checkpoints").is_dir() or not any(
                n.startswith("last_") for n in os.listdir(tmp_path / "run" / "checkpoints")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(min(map(int, ranks)), signal.SIGKILL)  # rank 0: started first
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "connectFullMesh" not in err, err
    assert "resumed from" in out and "epoch 4/4" in out, out
