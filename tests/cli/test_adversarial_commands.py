"""Issue 50's cases (reliability round 6): the plan, init, signals and TensorBoard, tried by a hostile user."""
import os
import re

import pytest
import torch
import yaml
from torch.nn.functional import cross_entropy

from helpers import error_lines, flat_mlp, tiny_config
from ignite_amp.cli.main import main


def write(tmp_path, cfg, name="c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _deep_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), *[torch.nn.Linear(256, 256) for _ in range(8)])


@pytest.mark.fake_trace
@pytest.mark.parametrize("cut", [{"micro_batches": 2}, {"accumulation_steps": 2}])
def test_the_plan_fits_the_steady_step_and_plans_the_one_time_split_check_apart(cut):
    # issue 50 item 1: the split check's gradients (once, on the first cut batch) were counted as every step's
    # peak: micro_batches=2 "fit" batch 1 where micro_batches=1 fit 429
    from ignite_amp.memory_plan.plan import estimate_memory

    model = _deep_mlp()
    opt = torch.optim.AdamW(model.parameters())
    batch = lambda n: (torch.randn(n, 256), torch.randint(0, 256, (n,)))  # noqa: E731
    plans = [estimate_memory(model, opt, cross_entropy, batch, [8], memory="14MiB", device="cpu", dtype="float32",
                             **kwargs) for kwargs in ({}, cut)]
    whole, split = plans
    assert whole.split_check is None and whole.largest_fit > 300
    if "micro_batches" in cut:  # smaller chunks: less activation memory, so a larger batch fits
        assert split.largest_fit > whole.largest_fit
    else:  # accumulation keeps the earlier batch's gradients: a little less fits, not "batch 1"
        assert whole.largest_fit > split.largest_fit > whole.largest_fit // 2
    size, peak = split.split_check
    assert size == 8 and peak > split.budget  # the check alone would not fit: the run skips it with a warning
    assert any(line.startswith("the first cut batches also run the split check") for line in split.lines())


@pytest.mark.fake_trace
def test_the_planned_split_check_is_the_real_first_steps_peak():
    from helpers.memory import Transformer, measured_peak, tokens
    from ignite_amp.memory_plan.plan import estimate_memory

    torch.manual_seed(0)
    model = Transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = estimate_memory(model, opt, cross_entropy, tokens, [8], device="cpu", dtype="bfloat16", micro_batches=4)
    real_first = measured_peak(model, opt, tokens, 8, dtype="bfloat16", micro_batches=4, check_split=True)
    assert plan.split_check[0] == 8 and abs(plan.split_check[1] - real_first) <= 0.001 * real_first
    assert plan.peaks[0].peak < plan.split_check[1]


@pytest.mark.parametrize("file, name, output_dir", [("my run.yaml", "my_run", "runs/my run"),
                                                    ("a[1].yml", "a_1_", "runs/a[1]"),
                                                    ("x'y\" #z.yaml", "x_y_z", "runs/x'y\" #z"),
                                                    ("plain-name.yaml", "plain-name", "runs/plain-name")])
def test_init_names_the_copy_after_any_file_name(tmp_path, monkeypatch, capsys, file, name, output_dir):
    # issue 50 item 3: a file name with a space or brackets kept name: quickstart and output_dir: runs/quickstart,
    # so training the copy resumed the user's earlier quickstart run
    from ignite_amp.config.tree import load_config

    monkeypatch.chdir(tmp_path)
    assert main(["init", "quickstart", "-o", file]) == 0
    cfg = load_config(file)
    assert (cfg.name, cfg.output_dir) == (name, output_dir)


@pytest.mark.parametrize("file", [".yaml", "..yml", "sub/...yaml"])
def test_init_refuses_a_file_name_that_is_only_a_suffix(tmp_path, monkeypatch, capsys, file):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert main(["init", "quickstart", "-o", file]) == 2
    assert error_lines(capsys.readouterr().err) == [f"ignite-amp: error: -o {file}: name the file, e.g. -o "
                                                    f"mine.yaml (the run is named after it)"]
    assert not (tmp_path / file).exists()


class _InterruptedFile:
    """A checkpoint's temp file whose third write gets the signal (as a signal handler raises inside the Python
    write that torch.save calls: torch's writer turns it into "unexpected pos")."""

    def __init__(self, f, interrupt):
        self.f, self.interrupt, self.writes = f, interrupt, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            raise self.interrupt()
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_checkpoint_write_is_the_signal_not_a_full_disk(tmp_path, monkeypatch, capsys,
                                                                          signal_name, code):
    # issue 50 item 4: torch.save turned the interrupt into "unexpected pos", which read as a full disk, exit 1
    import builtins

    import ignite_amp.files.checkpoints as checkpoints
    from ignite_amp.cli.failures import Terminated

    interrupt = Terminated if signal_name == "SIGTERM" else KeyboardInterrupt

    def open_(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _InterruptedFile(f, interrupt) if ".tmp-" in str(path) and "w" in mode else f

    monkeypatch.setattr(checkpoints, "open", open_, raising=False)
    assert main(["train", write(tmp_path, tiny_config(tmp_path))]) == code
    what = "terminated (SIGTERM)" if code == 143 else "interrupted"
    assert error_lines(capsys.readouterr().err) == [
        f"ignite-amp: {what}: no checkpoint was written yet: run the same command to start again"]
    assert not [n for n in (tmp_path / "run" / "checkpoints").iterdir() if ".tmp-" in n.name]


@pytest.mark.slow
def test_a_full_disk_at_the_first_save_does_not_promise_previous_checkpoints(tmp_path, monkeypatch, capsys):
    # issue 50 item 7: "the previous checkpoints are kept ... run the same command to resume" when there were none
    import ignite_amp.files.checkpoints as checkpoints

    def full(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1472 vs 1384")

    monkeypatch.setattr(checkpoints.torch, "save", full)
    assert main(["train", write(tmp_path, tiny_config(tmp_path))]) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith("ignite-amp: stopped: cannot write checkpoint ") and line.endswith(
        ": no space left on device; no checkpoint was written yet: free space and run the same command to start "
        "again"), line


def mlp_config(tmp_path, **kwargs):
    return tiny_config(tmp_path, model={"name": "helpers:flat_mlp", "num_classes": 10, "kwargs": kwargs})


@pytest.mark.slow
@pytest.mark.fake_trace
def test_plan_says_in_one_line_that_the_model_cannot_run_at_the_image_size(tmp_path, capsys):
    # issue 50 item 5: torch's fake-tensor traceback (20 lines), then exit 0 with a plan of a step that cannot run
    path = write(tmp_path, mlp_config(tmp_path))
    assert main(["plan", path, "--set", "data.image_size=8"]) == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == ["ignite-amp: error: model.name: helpers:flat_mlp cannot run on 3x8x8 "
                                "images (a and b must have same reduction dim, but got [2, 192] X [768, 64].); check "
                                "data.image_size and model.kwargs"], err
    assert "Traceback" not in err and "memory plan" not in out


@pytest.mark.slow
@pytest.mark.fake_trace
def test_plan_of_a_batchnorm_model_searches_from_batch_2(tmp_path, capsys):
    # issue 50 item 8: the fit search tried batch 1: "plan: Expected more than 1 value per channel", exit 2
    from ignite_amp.memory_plan.plan import estimate_memory

    model = flat_mlp(batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = lambda n: (torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,)))  # noqa: E731
    two = estimate_memory(model, opt, cross_entropy, batch, [2], device="cpu").peaks[0].peak
    for memory, fit in ((int(two / 0.85) + 1024, 2), (int(two / 0.85) - 16, 0), (100, 0)):
        plan = estimate_memory(model, opt, cross_entropy, batch, [32], device="cpu", memory=memory)
        assert plan.untraced is None and (plan.largest_fit >= 2 if fit else plan.largest_fit == 0), (memory, plan)
    path = write(tmp_path, mlp_config(tmp_path, batch_norm=True))
    assert main(["plan", path, "--memory", "100KiB"]) == 0
    assert "largest batch that fits 0.1 MiB less 15%: no batch size" in capsys.readouterr().out
    assert main(["plan", path, "--batch-sizes", "1", "4"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: plan: batch 1: Sequential cannot train on one sample (Expected more than 1 value per "
        "channel when training, got input size torch.Size([1, 64])); plan batch sizes of 2 or more"]


@pytest.mark.slow
@pytest.mark.fake_trace
def test_plan_builds_a_model_whose_constructor_reads_values_for_real(tmp_path, capsys):
    # issue 50 item 9: exit 2 "raised DataDependentOutputException", although the plan falls back to a real build
    path = write(tmp_path, mlp_config(tmp_path, reads_values=True))
    assert main(["plan", path]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ *32  ", out, re.M) and "could not be traced" not in out
    assert main(["plan", path, "--set", "model.kwargs.reads_values=false"]) == 0
    assert capsys.readouterr().out == out  # the same plan as the model built fake


@pytest.mark.slow
@pytest.mark.parametrize("number, line", [
    ("EFBIG", "ignite-amp: stopped: file too large for the file-size limit (ulimit -f) (writing TensorBoard's event "
              "files); no checkpoint was written yet: raise the limit and run the same command again"),
    ("EIO", "ignite-amp: internal error: OSError: [Errno 5] Input/output error (writing TensorBoard's event files) "
            "(the traceback is in {log})")])
def test_a_file_size_limit_in_tensorboard_s_writer_thread_is_one_line_naming_it(tmp_path, capsys, monkeypatch,
                                                                                number, line):
    # issue 50 item 6: "Exception in thread Thread-1: Traceback ..." then "internal error: OSError: [Errno 27] File
    # too large", naming no file
    import errno
    import threading

    from tensorboard.summary.writer import record_writer

    def limited(self, data):
        raise OSError(getattr(errno, number), os.strerror(getattr(errno, number)))

    monkeypatch.setattr(record_writer.RecordWriter, "write", limited)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # as outside pytest: print to stderr
    cfg = tiny_config(tmp_path, handlers={"tensorboard": {"log_every": 1}})
    assert main(["train", write(tmp_path, cfg)]) == 1
    err = capsys.readouterr().err
    assert error_lines(err) == [line.format(log=tmp_path / "run" / "train.log")], err
    assert "Traceback" not in err and "Exception in thread" not in err


def _tb_trainer(logdir, log_every=1):
    from ignite_amp import create_amp_trainer
    from ignite_amp.handlers import TensorBoardMetrics

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    tb = TensorBoardMetrics(str(logdir), log_every=log_every)
    tb.attach(trainer)
    g = torch.Generator().manual_seed(0)
    return trainer, tb, [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]


def _loss_points(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(str(logdir), "train"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")]


def test_a_trainer_runs_again_after_tensorboard_metrics_close(tmp_path):
    # issue 50 item 14: AttributeError: 'NoneType' object has no attribute 'add_summary'
    trainer, tb, data = _tb_trainer(tmp_path)
    trainer.run(data, max_epochs=1)
    tb.close()
    trainer.run(data, max_epochs=2)  # logs on, into new event files
    tb.close()
    tb.close()  # twice is fine
    assert _loss_points(tmp_path) == list(range(1, 9))
    assert "precision: float32 (autocast off), 8 optimizer steps" in tb.health()


def test_the_steps_a_resume_replays_are_one_point_each_in_tensorboard(tmp_path):
    # issue 50 item 15: a run stopped mid-epoch after logging, resumed from its epoch-end checkpoint, logged the
    # replayed steps again (two points per step)
    from ignite.engine import Events

    trainer, tb, data = _tb_trainer(tmp_path)
    trainer.run(data, max_epochs=1)
    saved = trainer.state_dict()
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=6), lambda e: e.terminate())  # killed mid-epoch 2
    trainer.run(data, max_epochs=2)
    tb.close()
    assert _loss_points(tmp_path) == list(range(1, 7))
    resumed, tb, data = _tb_trainer(tmp_path)  # a new process resumes from the checkpoint of epoch 1
    resumed.load_state_dict(saved)
    resumed.run(data, max_epochs=2)
    tb.close()
    assert _loss_points(tmp_path) == list(range(1, 9))  # iterations 5 and 6 once, not twice


@pytest.mark.slow
def test_plan_json_never_overwrites_the_config_or_another_file(tmp_path, capsys):
    # issue 50 item 12: plan my.yaml --json my.yaml wrote JSON over the config it read, exit 0
    path = write(tmp_path, tiny_config(tmp_path))
    before = open(path).read()
    assert main(["plan", path, "--json", path]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"ignite-amp: error: --json {path}: is the config the plan reads; name another file for the plan"]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["plan", path, "--json", str(notes)]) == 2
    assert "exists and is not an earlier plan" in capsys.readouterr().err
    assert open(path).read() == before and notes.read_text() == "mine"


@pytest.mark.parametrize("text", ["0.5", "80GiB80", "1e-4KiB", "GiB", ""])
def test_a_memory_size_refused_names_what_was_typed(text):
    # issue 50 item 13: "--memory 0.5" said "got 0", "80GiB80" "could not convert string to float"
    from ignite_amp.memory_plan.plan import parse_bytes

    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert str(info.value) == f"memory: expected a size such as 80GiB, 24GB or 512MiB (at least a byte), got {text!r}"
    assert parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes(".5KiB") == 512 and parse_bytes("2e3") == 2000


def test_a_full_output_of_a_command_without_a_run_promises_no_checkpoint(tmp_path, capsys, monkeypatch):
    # issue 50 item 13: ignite-amp configs > /dev/full said "no checkpoint was written yet"
    import errno
    import sys

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["configs"]) == 1
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: stopped: no space left on device (writing the output); free space and run the command again"]


def test_init_finds_a_folder_where_the_schema_goes_before_writing_the_config(tmp_path, capsys):
    # issue 50 item 13: it wrote the config, then exited 2; a rerun said the config exists
    (tmp_path / "ignite-amp.schema.json").mkdir()
    target = tmp_path / "q.yaml"
    assert main(["init", "-o", str(target)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"ignite-amp: error: {tmp_path / 'ignite-amp.schema.json'}: is a directory, where the config's JSON Schema "
        f"goes (its first line names it); move it, or write the config elsewhere"]
    assert not target.exists()


@pytest.mark.parametrize("old, new, name", [
    ("ignite_amp.checkpointing", "ignite_amp.transforms.activation_checkpointing", "checkpointed_blocks"),
    ("ignite_amp.sharding", "ignite_amp.transforms.sharding", "load_full_model_state"),
    ("ignite_amp.facts", "ignite_amp.step.facts", "config_facts"),
    ("ignite_amp.auto_checkpoint", "ignite_amp.memory_plan.auto_checkpoint", "checkpoint_to_fit"),
    ("ignite_amp.handlers.tensorboard_metrics", "ignite_amp.handlers.tensorboard.metrics", "TensorBoardMetrics"),
    ("ignite_amp.float8", "ignite_amp.transforms.float8", "convert_to_float8"),
    ("ignite_amp.device", "ignite_amp.core.device", "PEAK_TFLOPS")])
def test_the_paths_0_2_0_documented_import_with_a_warning_naming_the_new_one(monkeypatch, old, new, name):
    # issue 50 item 10: a bare ModuleNotFoundError
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}; import it from there \(the old path goes "
                                                rf"in 0.4.0\)$") as caught:
        found = {}
        exec(compile(f"from {old} import {name}", __file__, "exec"), found)  # as a user's script imports it
    assert found[name] is getattr(importlib.import_module(new), name)
    assert sys.modules[old] is sys.modules[new]
    assert caught[0].filename == __file__  # the importing line, not the import system's


def test_memory_plan_names_what_0_2_0_s_module_named():
    import ignite_amp.memory_plan as package
    from ignite_amp.memory_plan import plan

    for name in ("estimate_memory", "MemoryPlan", "StepPeak", "KINDS", "NOT_COUNTED", "DEFAULT_MARGIN", "parse_bytes",
                 "format_bytes"):
        assert getattr(package, name) is getattr(plan, name)


# The second adversarial pass (issue 50's closing note): what it found in plan and init, fixed.

@pytest.mark.slow
@pytest.mark.parametrize("target, why", [("adir", "is a directory"), ("no/such/x.json", "its folder does not exist")])
def test_plan_json_that_cannot_be_written_is_refused_before_the_plan(tmp_path, monkeypatch, capsys, target, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    path = write(tmp_path, tiny_config(tmp_path))
    assert main(["plan", path, "--json", target]) == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == [f"ignite-amp: error: --json {target}: cannot write ({why})"] and out == ""


def test_init_into_a_folder_written_with_a_slash_suggests_one_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    assert main(["init", "-o", "adir/"]) == 2
    assert error_lines(capsys.readouterr().err) == [
        "ignite-amp: error: -o adir/: is a directory; name the file to write, e.g. -o adir/quickstart.yaml"]


@pytest.mark.slow
@pytest.mark.fake_trace
def test_a_fit_at_the_search_s_cap_says_so(tmp_path, capsys):
    path = write(tmp_path, tiny_config(tmp_path))
    assert main(["plan", path, "--memory", "1e30B"]) == 0
    assert "the memory would fit batch 16777216 or more (the search stops there)" \
        in " ".join(capsys.readouterr().out.split())  # (the tiny config's data set caps it first)
