"""The split check by construction (issue 58): checkpointing suspended in the check, randomness keyed by sample, advice
verified on the measured gradients, state restored without in-place writes, ambiguous batches, spot checks."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from ignite.engine import Events
from torch import nn

from ignite_amp import create_amp_trainer
from ignite_amp.errors import SplitCheckError
from ignite_amp.split_check.randomness import still

transformers = pytest.importorskip("transformers")


def trainer_for(model, loss_fn, micro_batches=2, **kwargs):
    return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device="cpu",
                              dtype="float32", micro_batches=micro_batches, **kwargs)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


# -- 1. activation checkpointing and the check compose ---------------------------------------------------------------
def block():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16))


def dropout_blocks():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), *[block() for _ in range(3)], nn.Linear(16, 4))


@pytest.mark.parametrize("policy", [True, "selective"])
def test_checkpointed_blocks_with_dropout_and_micro_batches_train_as_without_the_check(policy):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    ends = []
    for check in (True, False):
        model = dropout_blocks()
        torch.manual_seed(1)
        trainer = trainer_for(model, F.cross_entropy, activation_checkpointing=policy, check_split=check)
        trainer.run(batches)
        ends.append(weights(model))
        if check:
            assert trainer.amp_step.split_check.batches == 3
    assert all(torch.equal(a, b) for a, b in zip(*ends, strict=True))  # the check changed nothing of the run


class ReentrantCheckpoints(nn.Module):
    """A user's own torch.utils.checkpoint calls, reentrant (refused by autograd.grad) and not, with dropout."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = block(), block(), nn.Linear(16, 4)
        self.inp = nn.Linear(10, 16)

    def forward(self, x):
        h = self.inp(x)
        h = torch.utils.checkpoint.checkpoint(self.a, h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=False)
        return self.head(h)


def test_a_users_reentrant_and_non_reentrant_checkpoints_are_checked_without_checkpointing():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x = torch.randn(8, 10, generator=g, requires_grad=False)
    trainer = trainer_for(ReentrantCheckpoints(), F.cross_entropy)
    trainer.run([(x, torch.randint(0, 4, (8,), generator=g))] * 3)
    assert trainer.amp_step.split_check.batches == 3
    import torch.utils.checkpoint as module  # the suspension is undone
    assert module.CheckpointFunction.__name__ == "CheckpointFunction"


def tiny_gpt2(**over):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, **over)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_transformers_own_gradient_checkpointing_with_dropout_is_checked():
    model = tiny_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    trainer = trainer_for(model, lambda out, y: out.loss, model_fn=lambda m, x: m(input_ids=x, labels=x))
    trainer.run([(ids, None)] * 3)
    assert trainer.amp_step.split_check.batches == 3


@pytest.mark.slow
def test_selective_checkpointing_of_a_gpt2_as_it_comes_turns_its_cache_off_and_trains(caplog):
    model = tiny_gpt2()
    assert model.config.use_cache  # transformers' default
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="ignite_amp"):
        trainer = trainer_for(model, lambda out, y: out.loss, model_fn=lambda m, x: m(input_ids=x, labels=x),
                              activation_checkpointing="selective")
    trainer.run([(ids, None)] * 3)
    assert not model.config.use_cache and trainer.amp_step.split_check.batches == 3
    assert any("use_cache set to False" in r.getMessage() for r in caplog.records)


def test_checkpointed_accumulation_is_checked_without_a_warning(caplog):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(6)]
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer = trainer_for(dropout_blocks(), F.cross_entropy, micro_batches=1, accumulation_steps=2,
                              activation_checkpointing=True)
        trainer.run(batches)
    assert trainer.amp_step.split_check.batches == 3 and not caplog.records


# -- 3. the same randomness for a sample in the part and in its pieces -----------------------------------------------
def test_a_sample_draws_the_same_values_in_a_batch_and_in_any_piece_of_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g)
    forwards = (("whole", [0, 1, 2, 3, 4, 5]), ("piece", [4, 1]), ("reordered", [5, 3, 0]))
    with still(nn.Linear(1, 1), forwards_only=True) as held:
        for _ in range(2):  # again where an axis was guessed wrong (the check does the same)
            drawn = {}
            for name, rows in forwards:
                with held.forward(x[rows], None, len(rows)):
                    drawn[name] = (torch.rand(len(rows), 4), torch.randn(len(rows) * 2, 3),  # one, two rows a sample
                                   torch.bernoulli(torch.full((5, len(rows)), 0.5)),  # batch-second
                                   torch.multinomial(torch.ones(7), len(rows) * 3, replacement=True), torch.rand(5))
            again, unkeyable = held.learn([len(rows) for _, rows in forwards])
            assert not unkeyable
            if not again:
                break
    for name, rows in forwards[1:]:
        whole, part = drawn["whole"], drawn[name]
        index = torch.tensor(rows)
        assert torch.equal(part[0], whole[0][index])
        assert torch.equal(part[1].view(len(rows), 2, 3), whole[1].view(6, 2, 3)[index])
        assert torch.equal(part[2], whole[2][:, index])
        assert torch.equal(part[3].view(len(rows), 3), whole[3].view(6, 3)[index])
        assert torch.equal(part[4], whole[4])  # no sample axis: the same values


class SelfMaskingMLM(nn.Module):
    """Draws its own token mask (a random count of tokens) inside forward and averages over the masked tokens."""

    def __init__(self, draw):
        super().__init__()
        self.emb, self.head, self.draw = nn.Embedding(24, 16), nn.Linear(16, 24), draw

    def forward(self, ids):
        masked = self.draw(ids)
        out = self.head(torch.tanh(self.emb(ids.masked_fill(masked, 0))))
        return F.cross_entropy(out[masked], ids[masked])


def test_a_mask_drawn_inside_the_model_is_stopped_not_passed_on_a_degenerate_draw():
    """rand held at 0.5 masked nothing (or everything): the check saw nothing and the run went 10-37% off."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(1, 24, (8, 12), generator=g), None) for _ in range(3)]
    torch.manual_seed(0)
    model = SelfMaskingMLM(lambda ids: torch.rand(ids.shape) < 0.15)
    with pytest.raises(SplitCheckError, match="the first chunk holds .* no num_items can count it: use "
                                              "micro_batches=1"):
        trainer_for(model, lambda out, y: out).run(batches)


def test_negatives_drawn_with_multinomial_are_keyed_per_sample_and_pass():
    """word2vec's negative sampling: n * k draws from one distribution, k per sample (a top-k stand-in made a row's
    draws depend on its place: "rows interact", or "selected index out of range" with more draws than classes)."""
    class Word2Vec(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k, self.inp, self.out = k, nn.Embedding(30, 8), nn.Embedding(30, 8)

        def forward(self, pair):
            n = len(pair)
            negatives = torch.multinomial(torch.ones(30), n * self.k, replacement=True).view(n, self.k)
            centre = self.inp(pair[:, 0])
            positive = F.logsigmoid((centre * self.out(pair[:, 1])).sum(-1))
            negative = F.logsigmoid(-(self.out(negatives) @ centre.unsqueeze(-1)).squeeze(-1)).sum(-1)
            return -(positive + negative).mean()

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 30, (8, 2), generator=g), None) for _ in range(3)]
    for k in (2, 5):
        torch.manual_seed(0)
        trainer = trainer_for(Word2Vec(k), lambda out, y: out)
        trainer.run(batches)
        assert trainer.amp_step.split_check.batches == 3


def test_a_permutation_of_the_batch_is_named_not_blamed_on_the_loss():
    class Mixup(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(5, 3)

        def forward(self, x):
            return self.net(0.7 * x + 0.3 * x[torch.randperm(len(x))])

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g))
    with pytest.raises(SplitCheckError, match=r"draws with torch\.randperm in a way no per-sample key can serve"):
        trainer_for(Mixup(), F.cross_entropy).run([batch])


# -- 4. advice that the check verified -------------------------------------------------------------------------------
def test_a_token_mean_whose_piece_holds_no_label_is_told_its_count_not_a_sum():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(24, 12), nn.Linear(12, 5))
    ids, y = torch.randint(1, 24, (8, 6)), torch.randint(0, 5, (8, 6))
    y[:, 4:] = -100
    y[6:] = -100
    loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    with pytest.raises(SplitCheckError, match=r"num_items=lambda x, y: \(y != -100\)\.sum\(\) fits") as info:
        trainer_for(copy.deepcopy(model), loss).run([(ids, y)] * 3)
    assert "is a sum" not in str(info.value)
    trainer = trainer_for(model, loss, num_items=lambda x, t: (t != -100).sum())
    trainer.run([(ids, y)] * 3)  # the advice, followed, passes
    assert trainer.amp_step.split_check.batches == 3


def test_a_ctc_sum_is_told_to_divide_by_the_samples_and_that_is_exact():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(5, 6)

        def forward(self, x):
            return self.net(x).log_softmax(-1).transpose(0, 1)

    g = torch.Generator().manual_seed(0)
    x, lengths = torch.randn(8, 12, 5, generator=g), torch.randint(1, 5, (8,), generator=g)
    batch = (x, (torch.randint(1, 6, (8, 4), generator=g), lengths))

    def ctc(reduction):
        loss = nn.CTCLoss(reduction=reduction)
        return lambda out, y: loss(out, y[0], torch.full((len(y[0]),), 12), y[1]).reshape(-1).mean()

    with pytest.raises(SplitCheckError, match=r"reduction='none', then \.mean\(\)"):
        trainer_for(Head(), ctc("sum")).run([batch])
    trainer = trainer_for(Head(), ctc("none"))
    trainer.run([batch] * 3)
    assert trainer.amp_step.split_check.batches == 3


def test_two_means_in_one_loss_are_not_told_that_rows_interact():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.cls, self.tok = nn.Embedding(20, 8), nn.Linear(8, 3), nn.Linear(8, 20)

        def forward(self, ids):
            h = self.emb(ids)
            return self.cls(h.mean(1)), self.tok(h)

    def loss(out, y):
        return F.cross_entropy(out[0], y[0]) + F.cross_entropy(out[1].flatten(0, 1), y[1].flatten())

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids, tokens = torch.randint(0, 20, (8, 6), generator=g), torch.randint(0, 20, (8, 6), generator=g)
    tokens[[0, 1], 1:] = -100  # the pieces hold different shares of the tokens than of the samples
    with pytest.raises(SplitCheckError, match="no weighting of the two pieces gives the part's gradient") as info:
        trainer_for(TwoHeads(), loss).run([(ids, (torch.randint(0, 3, (8,), generator=g), tokens))] * 3)
    text = str(info.value)
    assert "cannot tell why" in text and "adds means over different counts" in text
    assert "its rows interact (a sample" not in text


def test_fractional_num_items_weigh_as_themselves_and_the_step_is_exact_under_accumulation():
    """Per-sample weights with num_items=w.sum() (chunk sums under 1 were weighed as 1: a false alarm showing
    shares of 45% / 72%)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 4, generator=g), (torch.randint(0, 3, (4,), generator=g), torch.rand(4, generator=g)))
               for _ in range(4)]

    def loss(out, y):
        return (F.cross_entropy(out, y[0], reduction="none") * y[1]).sum() / y[1].sum()

    torch.manual_seed(0)
    start = nn.Linear(4, 3)
    model = copy.deepcopy(start)
    trainer = trainer_for(model, loss, micro_batches=1, accumulation_steps=2, num_items=lambda x, y: y[1].sum())
    trainer.run(batches)
    assert trainer.amp_step.split_check.batches == 3
    reference = copy.deepcopy(start)  # by hand: one weighted mean over each pair of batches
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        opt.zero_grad()
        x = torch.cat([first[0], second[0]])
        y = (torch.cat([first[1][0], second[1][0]]), torch.cat([first[1][1], second[1][1]]))
        loss(reference(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_part_whose_pieces_weigh_alike_by_coincidence_proves_nothing_and_the_other_halves_decide():
    """Class weights [1, 3, 0.5, 2]: the last halves (labels 1, 0 | 3, 3) weigh 4 and 4, as the samples do, while the
    step's chunks weigh 8 and 5: that pass proved nothing (the run went 34% off in silence); the first halves tell."""
    torch.manual_seed(0)
    weight = torch.tensor([1.0, 3.0, 0.5, 2.0])
    x, y = torch.randn(8, 6), torch.tensor([0, 1, 1, 0, 2, 2, 3, 3])
    loss = lambda out, t: F.cross_entropy(out, t, weight=weight)  # noqa: E731  (the weights read from the closure)
    with pytest.raises(SplitCheckError, match=r"num_items=lambda x, y: weight\[y\]\.sum\(\) .* fits"):
        trainer_for(nn.Linear(6, 4), loss).run([(x, y)])


# -- 5. state restored without in-place writes to what autograd saved -----------------------------------------------
def test_a_class_weight_buffer_in_a_dict_of_losses_gets_a_diagnosis_not_an_autograd_error():
    class Criterion(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.cls, self.tok = nn.Embedding(20, 8), nn.Linear(8, 3), nn.Linear(8, 20)
            self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5]))  # saved by autograd

        def forward(self, x):
            ids, labels, tokens = x
            h = self.emb(ids)
            return {"cls": F.cross_entropy(self.cls(h.mean(1)), labels, weight=self.class_weight),
                    "tok": F.cross_entropy(self.tok(h).flatten(0, 1), tokens.flatten())}

    g = torch.Generator().manual_seed(0)
    ids, tokens = torch.randint(0, 20, (8, 6), generator=g), torch.randint(0, 20, (8, 6), generator=g)
    tokens[torch.rand(8, 6, generator=g) < 0.5] = -100
    torch.manual_seed(0)
    with pytest.raises(SplitCheckError, match="adds means over different counts"):
        trainer_for(Criterion(), lambda out, y: sum(out.values())).run(
            [((ids, torch.randint(0, 3, (8,), generator=g), tokens), None)])


# -- 6. a batch of (images, list of target dicts) with two samples -------------------------------------------------
def test_two_images_and_their_two_target_dicts_are_cut_as_fields():
    class Boxes(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(12, 2)

        def forward(self, x):
            images, targets = x
            return F.mse_loss(self.net(images.flatten(1)), torch.stack([t["box"] for t in targets]))

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 2, 2, generator=g), [{"box": torch.randn(2, generator=g)} for _ in range(2)])
    trainer = trainer_for(Boxes(), lambda out, y: out)
    trainer.run([(x, None)] * 3)
    assert trainer.amp_step.split_check.batches == 3


# -- 7. spot checks through the run ------------------------------------------------------------------------------------
class Clock:
    """Fake time: each iteration takes 1 s and each read of the clock 0.25 s (a check reads it at its start and end:
    it takes 0.25 s)."""

    def __init__(self, trainer):
        self.now = 0.0
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self.tick)
        trainer.amp_step.split_check._clock = self

    def tick(self, _):
        self.now += 1.0

    def __call__(self):
        self.now += 0.25
        return self.now


def test_a_loss_that_goes_wrong_later_is_caught_by_a_spot_check():
    """A class-balanced loss (each class weighs the same) is exact while the first batches are balanced."""
    def balanced(out, y):
        per = F.cross_entropy(out, y, reduction="none")
        return torch.stack([per[y == c].mean() for c in y.unique()]).mean()

    g = torch.Generator().manual_seed(0)
    even = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    batches = [(torch.randn(8, 4, generator=g), even) for _ in range(6)]
    batches += [(torch.randn(8, 4, generator=g), torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])) for _ in range(6)]
    torch.manual_seed(0)
    trainer = trainer_for(nn.Linear(4, 2), balanced, check_split=0.25)
    Clock(trainer)
    with pytest.raises(SplitCheckError, match="give a gradient"):
        trainer.run(batches)
    check = trainer.amp_step.split_check
    assert check.spots >= 1 and 6 < trainer.state.iteration <= 6 + check.interval + 1


def test_spot_checks_keep_within_their_budget_and_the_summary_counts_them():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(40)]
    trainer = trainer_for(nn.Linear(4, 2), F.cross_entropy, check_split=0.1)
    check = trainer.amp_step.split_check
    clock = Clock(trainer)
    trainer.run(batches)
    assert check.interval == 3  # ceil(0.25 s / (0.1 * 1.08 s per step))
    assert check.spots * 0.25 <= 0.1 * clock.now and check.spots >= (40 - 3) // 4
    assert check.batches == 3 + check.spots
    assert check.summary() == f"split check: {check.batches} batches checked, exact within tolerance, " \
                              f"{check.spots} of them spot checks"


def test_the_default_spot_budget_is_two_percent_and_a_fraction_is_checked():
    from ignite_amp.split_check.check import SPOT_BUDGET, SplitCheck

    assert SplitCheck().budget == SPOT_BUDGET == 0.02 and SplitCheck(0.1).budget == 0.1
    assert not SplitCheck(False).enabled
    for bad in (0, 1.5, -0.1, "yes"):
        with pytest.raises(ValueError, match="check_split should be true or false or a fraction"):
            SplitCheck(bad)
