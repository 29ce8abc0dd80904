"""One plan for a run (issue 62): the config resolved once for its processes and device, each "auto" settled once
with its reason, and the run facts read from it."""
import pytest
import torch

from helpers import tiny_config
from ignite_amp.config.tree import load_config
from ignite_amp.core.collectives import global_batch, per_process
from ignite_amp.run.compose import build_run
from ignite_amp.run.plan import CHOICES, Settled, resolve

CPU = torch.device("cpu")


def test_one_rule_for_each_process_share_of_a_batch():
    assert [per_process(b, 4) for b in (64, 6, 3, 1)] == [16, 1, 1, 1]
    assert per_process(64, 1) == 64 and global_batch(16, 4) == 64
    with pytest.raises(ValueError):
        per_process(0, 2)


def test_the_run_plan_settles_the_batch_once_and_a_search_makes_a_new_plan():
    plan = resolve(load_config({"data": {"batch_size": 64, "eval_batch_size": 6}}), 4, CPU)
    assert (plan.batch_size, plan.per_process_batch) == (64, 16)
    assert (plan.eval_batch_size, plan.per_process_eval_batch) == (6, 1)
    auto = resolve(load_config({"data": {"batch_size": "auto"}}), 2, CPU)
    assert auto.batch_size is None and auto.per_process_batch is None and not auto.batch_searched
    found = auto.with_batch_size(global_batch(48, 2))
    assert (found.batch_size, found.per_process_batch, found.batch_searched) == (96, 48, True)
    assert found.config.data.batch_size == 96 and auto.config.data.batch_size == "auto"  # what config.yaml records


def test_a_choice_is_settled_once_with_its_reason():
    plan = resolve(load_config(), 1, CPU)
    settled = plan.settle(num_workers=Settled(0, "auto: 0 off a GPU"))
    assert plan.choice("num_workers") is None and settled.choice("num_workers") == (0, "auto: 0 off a GPU")
    with pytest.raises(ValueError, match="num_workers: settled already"):
        settled.settle(num_workers=Settled(2))
    with pytest.raises(ValueError, match="workers: not a choice of a run"):
        plan.settle(workers=Settled(2))
    assert set(CHOICES) >= {"dtype", "compile", "channels_last", "fused_optimizer", "num_workers", "data_on_device",
                            "prefetch", "activation_checkpointing"}
    assert settled.to_dict()["num_workers"] == {"value": 0, "why": "auto: 0 off a GPU"}


def test_a_built_run_settled_every_choice_and_its_facts_read_them(tmp_path):
    run = build_run(tiny_config(tmp_path, amp={"dtype": "auto"}), print_fn=lambda line: None)
    try:
        settled = dict(run.plan.settled)
        assert {"dtype", "compile", "channels_last", "fused_optimizer", "num_workers", "data_on_device",
                "prefetch"} <= set(settled)
        facts = run.facts
        assert facts["num_workers"] == settled["num_workers"].value and facts["num_workers_why"] == \
            settled["num_workers"].why
        assert facts["batch_size"] == run.plan.batch_size == run.cfg.data.batch_size
        assert facts["dtype_auto"] == run.dtype_why == settled["dtype"].why != ""
        assert facts["compile"] is False and facts["channels_last"] is False  # (auto: off on a CPU)
    finally:
        run.close()
