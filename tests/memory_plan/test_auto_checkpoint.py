"""activation_checkpointing auto: the fewest blocks that make the planned step fit; the block rule's runs."""
import pytest
import torch
import yaml
from torch import nn
from torch.nn.functional import cross_entropy

import ignite_amp.memory_plan.auto_checkpoint as auto_checkpoint
from ignite_amp import create_amp_trainer, load_config
from ignite_amp.memory_plan.auto_checkpoint import checkpoint_to_fit
from ignite_amp.transforms.blocks import block_names
from ignite_amp.transforms.activation_checkpointing import checkpoint_blocks, checkpointed_blocks
from ignite_amp.memory_plan.plan import estimate_memory

from conftest import assert_doctests_pass, tiny_config

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


@pytest.fixture(scope="module")
def peaks():
    """The planned peak at batch 512 with the first k blocks checkpointed, k = 0..6."""
    model = stem_blocks_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = block_names(model)
    return {k: estimate_memory(model, opt, cross_entropy, features, [512], device="cpu", dtype="float32", fit=False,
                               checkpoint=names[:k]).peaks[0].peak for k in (0, 2, 3, 6)}


def test_auto_checkpoints_the_fewest_blocks_that_fit(peaks):
    assert peaks[0] > peaks[2] > peaks[3] > peaks[6]
    memory = (peaks[2] + peaks[3]) / 2 / 0.85  # 3 blocks fit, 2 do not
    model = stem_blocks_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    choice = checkpoint_to_fit(model, opt, cross_entropy, features, 512, memory=int(memory), device="cpu",
                               dtype="float32")
    assert choice.checkpointed == ["2", "3", "4"] == checkpointed_blocks(model) and choice.fits
    assert choice.peak == peaks[3] and choice.peak_without == peaks[0]
    assert "3 of 6 blocks (2-4)" in choice.line()
    # create_amp_trainer keeps them; with enough memory none; with too little all, and the line says so.
    create_amp_trainer(model, opt, cross_entropy, device="cpu", dtype="float32")
    assert checkpointed_blocks(model) == ["2", "3", "4"]
    roomy = checkpoint_to_fit(model, opt, cross_entropy, features, 512, memory=2 * peaks[0], device="cpu",
                              dtype="float32")
    assert roomy.checkpointed == [] and "none of 3 blocks needed" in roomy.line()  # 3 left unchecked
    small = stem_blocks_head()
    tight = checkpoint_to_fit(small, torch.optim.SGD(small.parameters(), lr=0.1), cross_entropy, features, 512,
                              memory=peaks[6] // 2, device="cpu", dtype="float32")
    assert len(tight.checkpointed) == 6 and not tight.fits and "does not fit even so" in tight.line()
    with pytest.raises(ValueError, match="checkpoint_to_fit"):
        create_amp_trainer(small, opt, cross_entropy, device="cpu", activation_checkpointing="auto")


def test_a_config_says_auto_a_cpu_run_checkpoints_nothing_and_the_plan_names_the_blocks(tmp_path, capsys):
    from ignite_amp.cli.main import main
    from ignite_amp.run.compose import build_run

    cfg = tiny_config(tmp_path, amp={"dtype": "bfloat16", "activation_checkpointing": "auto"})
    assert load_config(cfg)["amp"]["activation_checkpointing"] == "auto"
    with pytest.raises(ValueError, match="amp.activation_checkpointing: expected true or false or auto or selective, got \"some\""):
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
    peak = float(full.split("| 32 | ")[1].split(" MiB")[0]) * 2 ** 20
    assert main(["plan", str(path), "--batch-sizes", "32", "--memory", str(int(peak * 0.9 / 0.85))]) == 0
    out = capsys.readouterr().out
    assert "activation checkpointing auto: 1 of 4 blocks (0): planned peak" in out, out
    cfg["data"]["batch_size"] = "auto"
    with pytest.raises(ValueError, match="auto fits the blocks to data.batch_size, which is auto too"):
        build_run(cfg, print_fn=lines.append)


def test_docstring_examples():
    assert_doctests_pass(auto_checkpoint)
