
import pytest
import torch
from ignite.engine import Events
from ignite.metrics import Accuracy
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

import ignite_amp.handlers.oom_backoff
from helpers import OOMAbove, assert_doctests_pass, id_batches
from ignite_amp import create_amp_evaluator, create_amp_trainer
from ignite_amp.config.tree import ConfigError
from ignite_amp.handlers import BatchSizeFloorError, OOMBackoff
from ignite_amp.handlers.oom_backoff import backoff_micro_batches, micro_batch_size
from ignite_amp.run.compose import build_run


def test_docstring_examples():
    assert_doctests_pass(ignite_amp.handlers.oom_backoff)


@pytest.mark.parametrize("batch, chunks, expected", [
    (256, 1, 2), (256, 2, 4), (256, 128, 256), (256, 256, None), (10, 1, 2), (10, 2, 5), (10, 5, 10),
    (9, 1, 3), (9, 3, 9), (7, 1, 3), (7, 3, 7), (1, 1, None),
])
def test_backoff_halves_the_micro_batch(batch, chunks, expected):
    assert backoff_micro_batches(batch, chunks) == expected
    if expected is not None:
        assert micro_batch_size(batch, expected) <= max(1, micro_batch_size(batch, chunks) // 2)


def make(limit, lr=0.1, backoff=None, seed=0):
    torch.manual_seed(seed)
    model = OOMAbove(limit=limit)
    # The stand-in records every forward's samples: the split check's own forwards
    # (tests/split_check/test_split_check.py) would be counted too.
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), cross_entropy,
                                 device="cpu", dtype="float32", check_split=False)
    if backoff is not None:
        backoff.attach(trainer)
    return model, trainer


@pytest.mark.slow
def test_training_completes_every_sample_once_and_weights_match_reference():
    batches = id_batches(40, 8)
    ref, ref_trainer = make(limit=1000)
    ref_trainer.run(batches, max_epochs=3)
    backoff = OOMBackoff()
    model, trainer = make(limit=3, backoff=backoff)
    per_epoch = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED,
                              lambda e: per_epoch.append(sorted(model.seen)) or model.seen.clear())
    trainer.run(batches, max_epochs=3)
    assert per_epoch == [list(range(40))] * 3  # every sample of every epoch exactly once
    assert trainer.amp_step.micro_batches == 4 and backoff.events == 2
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_floor_stops_the_run_with_one_line():
    model, trainer = make(limit=3, backoff=OOMBackoff(min_batch_size=4))
    with pytest.raises(BatchSizeFloorError) as info:
        trainer.run(id_batches(16, 8), max_epochs=1)
    assert str(info.value) == "out of memory even at micro-batch size 4 on cpu (min_batch_size 4)"


@pytest.mark.parametrize("error", [KeyError("k"), RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_other_errors_are_not_swallowed(error):
    backoff = OOMBackoff()
    model, trainer = make(limit=1000, backoff=backoff)
    model.forward = lambda x: (_ for _ in ()).throw(error)
    with pytest.raises(type(error)) as info:
        trainer.run(id_batches(16, 8), max_epochs=1)
    assert info.value is error and backoff.events == 0


@pytest.mark.slow
def test_evaluator_backs_off_too():
    model = OOMAbove(limit=3)
    evaluator = create_amp_evaluator(model, {"accuracy": Accuracy()}, device="cpu", dtype="float32")
    OOMBackoff().attach(evaluator)
    state = evaluator.run(id_batches(16, 8))
    reference = create_amp_evaluator(OOMAbove(limit=1000), {"accuracy": Accuracy()}, device="cpu", dtype="float32")
    reference.amp_step.model.load_state_dict(model.state_dict())
    assert state.metrics["accuracy"] == reference.run(id_batches(16, 8)).metrics["accuracy"]
    assert evaluator.amp_step.micro_batches == 4


@pytest.mark.slow
def test_grow_after_tries_larger_again_and_still_loses_nothing():
    backoff = OOMBackoff(grow_after=2)
    model, trainer = make(limit=4, backoff=backoff)
    sizes = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: sizes.append(e.amp_step.micro_batches))
    trainer.run(id_batches(48, 8), max_epochs=1)
    assert sorted(model.seen) == list(range(48))
    # The retried iteration completes cleanly and counts: OOM at 1 (-> 2 chunks), 2 clean -> grow to 1,
    # OOM at 3, 4 clean -> grow, OOM at 5, 6 -> grow. (Recorded after the grow at ITERATION_COMPLETED.)
    assert backoff.events == 3 and sizes == [2, 1, 2, 1, 2, 1]


def test_mode_batch_shrinks_the_loader_from_the_next_epoch():
    x = torch.randn(24, 5)
    x[:, 0] = torch.arange(24, dtype=torch.float32)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (24,))), batch_size=8, shuffle=True)
    backoff = OOMBackoff(mode="batch")
    model, trainer = make(limit=4, backoff=backoff)
    seen, batch_sizes = [], []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: batch_sizes.append(e.amp_step.batch_size))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(sorted(model.seen)) or model.seen.clear())
    trainer.run(loader, max_epochs=3)
    assert seen == [list(range(24))] * 3
    assert batch_sizes == [8] * 3 + [4] * 6 + [4] * 6
    assert trainer.state.epoch == 3 and trainer.state.iteration == 18 and trainer.amp_step.micro_batches == 1
    assert backoff.state_dict()["loader_batch_size"] == 4


def test_mode_batch_sizes_the_loader_from_the_full_batch_not_the_partial_last_one():
    """Batch 16 split in 2 (micro-batch 8), the epoch's last batch 5: the loader yields 8, not 3."""
    x = torch.randn(37, 5)
    x[:, 0] = torch.arange(37, dtype=torch.float32)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (37,))), batch_size=16)
    backoff = OOMBackoff(mode="batch")
    model, trainer = make(limit=8, backoff=backoff)
    trainer.run(loader, max_epochs=2)
    assert backoff.loader_batch_size == 8 and trainer.state.dataloader.batch_size == 8
    assert sorted(model.seen) == sorted(list(range(37)) * 2)


def test_state_round_trip_and_bad_arguments():
    backoff = OOMBackoff(grow_after=3)
    backoff.load_state_dict({"events": 2, "loader_batch_size": 16, "history": [1, 2], "clean": 1})
    assert backoff.state_dict() == {"events": 2, "loader_batch_size": 16, "history": [1, 2], "clean": 1}
    with pytest.raises(ValueError, match="min_batch_size should be a positive integer"):
        OOMBackoff(min_batch_size=0)
    with pytest.raises(ValueError, match="mode should be one of micro_batch, batch"):
        OOMBackoff(mode="halve")
    with pytest.raises(ValueError, match="grow_after should be a positive integer or None"):
        OOMBackoff(grow_after=0)


def oom_cfg(quick_cfg, **over):
    cfg = dict(quick_cfg, model={"name": "helpers:oom_cnn", "num_classes": 10, "kwargs": {"limit": 8}},
               amp={"dtype": "float32"})
    cfg["data"] = dict(cfg["data"], batch_size=32)
    cfg.update(over)
    return cfg


@pytest.mark.slow
def test_config_run_with_backoff_completes_and_resumes_at_the_size_that_worked(quick_cfg):
    run = build_run(oom_cfg(quick_cfg), print_fn=lambda *a: None)
    run.train()
    assert run.trainer.amp_step.micro_batches == 4  # 32 -> 16 -> 8 per chunk
    assert run.to_save["oom_backoff"].events == 2
    again = build_run(oom_cfg(quick_cfg, train={"epochs": 3}, scheduler={"name": "none"}), print_fn=lambda *a: None)
    assert again.resumed_from and again.trainer.amp_step.micro_batches == 4
    assert again.to_save["oom_backoff"].events == 2


@pytest.mark.slow
def test_config_without_backoff_fails_on_oom(quick_cfg):
    run = build_run(oom_cfg(quick_cfg, handlers={"oom_backoff": {"enabled": False}}), print_fn=lambda *a: None)
    with pytest.raises(torch.OutOfMemoryError):
        run.train()


@pytest.mark.slow
def test_mode_batch_refuses_fixed_length_schedules(quick_cfg):
    with pytest.raises(ConfigError, match="handlers.oom_backoff.mode: batch changes the steps per epoch"):
        build_run(oom_cfg(quick_cfg, scheduler={"name": "cosine"}, handlers={"oom_backoff": {"mode": "batch"}}))
