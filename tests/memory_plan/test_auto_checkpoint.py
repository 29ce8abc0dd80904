"""activation_checkpointing auto: the cheapest choice (none, selective, full on some blocks) that makes the planned
step fit, priced in memory and recompute FLOPs; the block rule's runs."""
import json
import re

import pytest
import torch
import yaml
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.memory_plan.auto_checkpoint as auto_checkpoint
from helpers import assert_doctests_pass, tiny_config
from ignite_amp import create_amp_trainer, load_config
from ignite_amp.memory_plan.auto_checkpoint import _ladder, checkpoint_to_fit
from ignite_amp.memory_plan.choices import OptionPlanner
from ignite_amp.step.facts import step_facts
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks, checkpoint_policies, checkpointed_blocks
from ignite_amp.transforms.blocks import block_names

pytestmark = pytest.mark.fake_trace  # runs after the tests that fork (see conftest)


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def stem_blocks_head(blocks=6, width=64):
    """A stem, six blocks and a head in one nn.Sequential: the blocks are a run of one class."""
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), *[Block(width) for _ in range(blocks)], nn.LayerNorm(width),
                         nn.Linear(width, 10))


def features(n):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_the_block_rule_finds_the_run_of_blocks_in_a_mixed_sequential():
    model = stem_blocks_head()
    assert block_names(model) == [str(i) for i in range(2, 8)]
    with _no_warning():
        assert checkpoint_blocks(model) == [str(i) for i in range(2, 8)]
    # Runs need two in a row holding parameters; stages (Sequentials) inside a mixed container are walked into.
    assert block_names(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())) == []
    stages = nn.Sequential(nn.Linear(16, 8), nn.Sequential(Block(8), Block(8)), nn.Sequential(Block(8), Block(8)),
                           nn.Linear(8, 2))
    assert block_names(stages) == ["1.0", "1.1", "2.0", "2.1"]
    convs = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU()) for _ in range(3)], nn.Flatten(),
                          nn.LazyLinear(2))  # blocks that are Sequentials of layers, then a head
    assert block_names(convs) == ["0", "1", "2"]
    # All children of one class: the rule as before, containers included.
    same = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    assert block_names(same) == ["0", "1", "2"]


class _no_warning:
    def __enter__(self):
        import warnings

        self.catcher = warnings.catch_warnings(record=True)
        self.seen = self.catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self.catcher.__exit__(*exc)
        assert not [w for w in self.seen if "activation checkpointing" in str(w.message)]


class GeluBlock(Block):
    """GELU keeps its input for the backward, the next Linear its output: selective checkpointing saves the latter."""

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def gelu_blocks():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *[GeluBlock() for _ in range(6)], nn.LayerNorm(64),
                         nn.Linear(64, 10))


def fit(memory, model=None):
    model = model or gelu_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, checkpoint_to_fit(model, opt, cross_entropy, features, 512, memory=int(memory / 0.85), device="cpu",
                                    dtype="float32")


@pytest.fixture(scope="module")
def planner():
    """The choices at batch 512, each traced once."""
    model = gelu_blocks()
    return OptionPlanner(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, features, 512,
                         device="cpu", dtype="float32")


def test_the_choices_price_memory_and_recompute(planner):
    none, selective, full = planner(0, 0), planner(0, 6), planner(6, 0)
    assert none.peak > selective.peak > full.peak
    assert none.recompute == 0 and 0 < selective.recompute < 0.01 < 0.1 < full.recompute < 0.5
    assert [planner(0, k).peak for k in range(7)] == sorted((planner(0, k).peak for k in range(7)), reverse=True)
    # selective saves more per FLOP than going on to full: selective on 1..6 blocks, then full on 1..6 of them
    assert _ladder(planner) == [(0, k) for k in range(7)] + [(k, 6 - k) for k in range(1, 7)]
    assert planner(2, 4).name == "full 2 + selective 4/6" and planner(0, 0).name == "none"


@pytest.mark.slow
def test_auto_takes_the_cheapest_choice_that_fits(planner):
    # Between selective on 2 and on 3 blocks: selective on the first 3, a fraction of a percent of recompute.
    model, choice = fit((planner(0, 2).peak + planner(0, 3).peak) / 2)
    assert checkpoint_policies(model) == dict.fromkeys(["2", "3", "4"], "selective") and choice.fits
    assert choice.peak == planner(0, 3).peak and choice.peak_without == planner(0, 0).peak
    assert choice.recompute == planner(0, 3).recompute < 0.01
    assert "selective on 3 of 6 blocks (selective: 2-4): planned peak" in choice.line()
    # Below all selective: the first blocks full, the rest selective; cheaper than full on all of them.
    model, choice = fit((planner(1, 5).peak + planner(2, 4).peak) / 2)
    assert checkpoint_policies(model) == {"2": "full", "3": "full", **dict.fromkeys(["4", "5", "6", "7"], "selective")}
    assert choice.fits and choice.recompute == planner(2, 4).recompute < planner(6, 0).recompute
    assert "full on 2 and selective on 4 of 6 blocks (full: 2-3; selective: 4-7)" in choice.line()
    assert "| full 2 + selective 4/6 (chosen) |" in "\n".join(choice.lines())
    # create_amp_trainer keeps them; with enough memory none; with too little all full, and the line says so.
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32")
    assert checkpointed_blocks(model) == [str(i) for i in range(2, 8)]
    assert step_facts(trainer.amp_step)["checkpointed_blocks"] == "2-7 (selective: 4-7)"
    model, roomy = fit(2 * planner(0, 0).peak)
    assert roomy.checkpointed == [] and "none of 6 blocks needed" in roomy.line()
    model, tight = fit(planner(6, 0).peak // 2)
    assert set(checkpoint_policies(model).values()) == {"full"} and len(tight.checkpointed) == 6
    assert not tight.fits and "does not fit even so" in tight.line()
    with pytest.raises(ValueError, match="checkpoint_to_fit"):
        create_amp_trainer(gelu_blocks(), torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                           activation_checkpointing="auto")


def test_a_model_whose_selective_checkpointing_saves_nothing_gets_full(planner):
    """ReLU keeps its output, which the next Linear needs anyway: selective keeps more than none (the Linears'
    outputs), so the ladder is full checkpointing alone."""
    model = stem_blocks_head()
    relu = OptionPlanner(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, features, 512,
                         device="cpu", dtype="float32")
    assert relu(0, 6).peak >= relu(0, 0).peak
    assert _ladder(relu) == [(k, 0) for k in range(7)]


@pytest.mark.slow
def test_a_config_says_auto_a_cpu_run_checkpoints_nothing_and_the_plan_names_the_blocks(tmp_path, capsys):
    from ignite_amp.cli.main import main
    from ignite_amp.run.compose import build_run

    cfg = tiny_config(tmp_path, amp={"dtype": "bfloat16", "activation_checkpointing": "auto"})
    assert load_config(cfg).amp.activation_checkpointing == "auto"
    with pytest.raises(ValueError, match="amp.activation_checkpointing: expected true or false or auto or selective, "
                                         "got \"some\""):
        load_config(tiny_config(tmp_path, amp={"activation_checkpointing": "some"}))
    lines = []
    run = build_run(cfg, print_fn=lines.append)
    run.close()
    assert any("activation checkpointing auto: no block checkpointed: no device memory" in line for line in lines)
    assert checkpointed_blocks(run.model) == []
    # ignite-amp plan for a GPU's memory: the blocks a run would checkpoint at the config's batch size (32)
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path), "--batch-sizes", "32"]) == 0
    full = capsys.readouterr().out
    peak = float(re.search(r"^ *32 +([0-9.]+)", full, re.M).group(1)) * 2 ** 20  # the table is in MiB
    assert main(["plan", str(path), "--batch-sizes", "32", "--memory", f"{int(peak * 0.9 / 0.85)}B"]) == 0
    out = capsys.readouterr().out
    said = " ".join(out.split())  # (the lines wrap at 80 columns)
    assert "activation checkpointing auto: selective on 1 of 4 blocks (selective: 0): planned peak" in said, out
    assert "recompute 0.40% of the step's FLOPs" in said, out
    # and the table of the choices, which --checkpointing shows for any config (and --json writes)
    assert "activation checkpointing choices at batch 32" in out, out
    table = out[out.index("activation checkpointing choices at batch 32"):].splitlines()
    assert [row.split(" | ")[0] for row in table[3:]] == ["| none", "| selective 1/4", "| selective 2/4",
                                                          "| selective 3/4", "| selective 4/4", "| full 1/4",
                                                          "| full 2/4", "| full 3/4", "| full 4/4"], table
    assert table[3].endswith("| 0.0% | no |") and table[-1].endswith("| yes |")
    cfg["amp"]["activation_checkpointing"] = False
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path), "--batch-sizes", "32", "--checkpointing", "--json", str(tmp_path / "p.json")]) == 0
    options = json.load(open(tmp_path / "p.json"))["checkpoint_options"]
    assert [(o["full"], o["selective"]) for o in options][::4] == [(0, 0), (0, 4), (4, 0)]
    assert options[-1]["recompute"] > 0.1 and options[-1]["peak"] < options[0]["peak"]
    cfg["amp"]["activation_checkpointing"] = "auto"
    cfg["data"]["batch_size"] = "auto"
    with pytest.raises(ValueError, match="auto fits the blocks to data.batch_size, which is auto too"):
        build_run(cfg, print_fn=lines.append)


def test_docstring_examples():
    assert_doctests_pass(auto_checkpoint)
