"""The split check, round 2 (issue 49): inconclusive is not a pass, enough of the data is seen, 0-item chunks,
batchmean, a batch the check cannot cut, randomness and state held still, the diagnosis of two means."""
import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import hand_loop
from ignite_amp import create_amp_trainer
from ignite_amp.errors import SplitCheckError
from ignite_amp.split_check.check import REPEATS, TRIES


def trainer_for(model, loss_fn, micro_batches=2, **kwargs):
    return create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, device="cpu",
                              dtype="float32", micro_batches=micro_batches, **kwargs)


def one_line(info):
    text = str(info.value)
    assert "\n" not in text and text.startswith("split check: "), text
    return text


def assert_same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# -- 1. an inconclusive check is tried again ---------------------------------------------------------------------
def hinge(z, y):
    """A margin between each sample and its nearest other sample: pairs met across the chunks."""
    return F.relu(0.5 - (torch.cdist(z, z) + 1e9 * torch.eye(len(z)))).sum(1).mean()


def test_pairs_split_across_the_chunks_are_seen_not_taken_for_a_pass():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g) * 100
    x = torch.cat([x, x + 0.01])  # sample i pairs with sample i + 4: each chunk alone has a zero loss
    torch.manual_seed(0)
    with pytest.raises(SplitCheckError, match="rows interact") as info:
        trainer_for(nn.Linear(4, 4), hinge).run([(x, torch.arange(8))])
    one_line(info)


def test_a_zero_gradient_is_inconclusive_and_the_next_batch_is_checked():
    total = lambda out, y: F.relu(out - y).sum()  # noqa: E731  (a sum, with a zero gradient while out < y)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g)
    met, unmet = torch.full((6, 2), 1e3), torch.full((6, 2), -1e3)
    trainer = trainer_for(nn.Linear(3, 2), total, check_split=True)
    with pytest.raises(SplitCheckError, match="so the loss is a sum"):
        trainer.run([(x, met), (x, unmet)])
    assert trainer.state.iteration == 2  # the first batch was inconclusive, the second decided


def test_a_loss_that_never_gives_a_gradient_is_said_unchecked(caplog):
    zero = lambda out, y: (out * 0).sum() / len(out)  # noqa: E731
    trainer = trainer_for(nn.Linear(3, 2), zero)
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        trainer.run([(torch.ones(4, 3), None)] * (TRIES + 2))
    from ignite_amp.split_check.check import _VAGUE

    assert [r.getMessage() for r in caplog.records if "inconclusive" in r.getMessage()] == [
        f"split check: inconclusive on {TRIES} batches ({_VAGUE}, each time): the weighting of the chunks is not "
        f"checked yet; spot checks go on through the run",
        f"split check: inconclusive on all {TRIES} batches it tried ({_VAGUE}): the weighting of the chunks was "
        f"never checked"]  # and at the run's end
    assert trainer.amp_step._split_check.tries == TRIES


# -- 2. more samples, on a few batches ---------------------------------------------------------------------------
def test_class_weighted_cross_entropy_is_stopped_with_its_count_and_exact_with_it():
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
    torch.manual_seed(0)
    model = nn.Linear(10, 2)
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(SplitCheckError, match=re.escape("num_items=lambda x, y: weight[y].sum() (weight: the loss's "
                                                        "class weights) fits")) as info:
        trainer_for(copy.deepcopy(model), crit).run([(x, y)])
    one_line(info)
    counted, reference = copy.deepcopy(model), copy.deepcopy(model)
    trainer_for(counted, crit, num_items=lambda x, y: crit.weight[y].sum()).run([(x, y)])
    hand_loop(reference, [(x, y)], lambda m, b: crit(m(b[0]), b[1]))
    assert_same_weights(counted, reference)


def test_a_part_whose_pieces_weigh_alike_by_coincidence_is_decided_by_the_batchs_other_halves():
    """The first batch's pieces (the last half of each chunk) happen to hold the same class weight while its chunks
    do not (issue 58): that pass proves nothing, and the batch's first halves tell at once."""
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]))
    g = torch.Generator().manual_seed(1)
    even, uneven = torch.tensor([0, 0, 1, 0]), torch.tensor([0, 1, 1, 1])
    trainer = trainer_for(nn.Linear(10, 2), crit)
    with pytest.raises(SplitCheckError, match=re.escape("weight[y].sum()")):
        trainer.run([(torch.randn(4, 10, generator=g), even), (torch.randn(4, 10, generator=g), uneven)])
    assert trainer.state.iteration == 1


def test_a_mean_is_checked_on_a_few_batches_then_left_alone():
    calls = []

    def mean(out, y):
        calls.append(len(out))
        return F.cross_entropy(out, y)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(REPEATS + 2)]
    trainer = trainer_for(nn.Linear(5, 3), mean)
    trainer.run(batches)
    assert trainer.amp_step._split_check.passes == REPEATS
    # each checked batch: its part (half of each of the step's two chunks, joined) and the two halves, then the
    # step's 2 chunks (the first batch's first chunk doubled too: the step's check for a sum); then the chunks only
    assert calls == [4, 2, 2, 4, 8, 4] + [4, 2, 2, 4, 4] * (REPEATS - 1) + [4, 4] * 2


# -- 3. a chunk that counts no items -----------------------------------------------------------------------------
def test_a_chunk_without_positives_keeps_its_gradient():
    """A focal loss normalised by the positives (torchvision's RetinaNet: / max(1, positives)): background-only
    images have no positive and still push the negatives down."""
    from torchvision.ops import sigmoid_focal_loss

    focal = lambda p, t: sigmoid_focal_loss(p, t, reduction="sum") / t.sum().clamp(min=1)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, generator=g)
    y = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0], [0.0] * 6, [0.0] * 6])
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    trainer = trainer_for(model, focal, num_items=lambda x, y: y.sum())
    trainer.run([(x, y)])
    hand_loop(reference, [(x, y)], lambda m, b: focal(m(b[0]), b[1]))
    assert_same_weights(model, reference)
    assert trainer.amp_step._split_check.last < 1e-5  # checked, not skipped
    with torch.no_grad():  # the batch's loss is the whole batch's too
        torch.testing.assert_close(trainer.amp_step.loss, focal(start(x), y))


# -- 4. batchmean ------------------------------------------------------------------------------------------------
def test_kl_div_batchmean_is_a_per_sample_mean_and_its_sum_gets_the_right_advice():
    """Distillation's loss: KLDivLoss(reduction="batchmean") is exact under micro-batches, checked, not refused."""
    kl = nn.KLDivLoss(reduction="batchmean")
    loss_fn = lambda out, teacher: kl(F.log_softmax(out, -1), teacher)  # noqa: E731
    loss_fn.reduction = "batchmean"  # as a wrapper that forwards the attribute would say it
    g = torch.Generator().manual_seed(0)
    x, teacher = torch.randn(6, 5, generator=g), torch.softmax(torch.randn(6, 3, generator=g), -1)
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    for fn in (kl, loss_fn):  # the module itself takes log-probabilities: a model giving them
        trainer_for(copy.deepcopy(model), fn)  # built, not refused
    trainer = trainer_for(model, loss_fn)
    trainer.run([(x, teacher)])
    hand_loop(reference, [(x, teacher)], lambda m, b: loss_fn(m(b[0]), b[1]))
    assert_same_weights(model, reference)
    assert trainer.amp_step._split_check.last < 1e-5
    with pytest.raises(ValueError, match=r"reduction='sum' is a sum .* use reduction='batchmean' \(the mean over "
                                         r"the samples; 'mean' would also divide by the classes\)"):
        trainer_for(nn.Linear(5, 3), nn.KLDivLoss(reduction="sum"))


# -- 7. a batch the check cannot cut -----------------------------------------------------------------------------
def augmix_batch(images, seed=0):
    """AugMix's batch: three views of each image stacked (clean, then two augmentations), the targets repeated."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(images, 6, generator=g)
    x = torch.cat([clean, clean + 0.1 * torch.randn(images, 6, generator=g), clean.flip(1)])
    return x, torch.randint(0, 3, (images,), generator=g).repeat(3)


def by_views(x, y, chunks):
    """Each chunk the same images of every view, stacked as the loss expects them."""
    xs, ys = [torch.tensor_split(v, chunks) for v in x.chunk(3)], [torch.tensor_split(v, chunks) for v in y.chunk(3)]
    return [(torch.cat([v[i] for v in xs]), torch.cat([v[i] for v in ys])) for i in range(chunks)]


def test_stacked_views_the_default_cut_breaks_are_one_line_naming_split_batch(caplog):
    from timm.loss import JsdCrossEntropy

    jsd = JsdCrossEntropy(num_splits=3, smoothing=0.0)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    with caplog.at_level(logging.INFO, logger="ignite_amp"):  # accumulation keeps each batch whole: it trains
        trainer = trainer_for(copy.deepcopy(model), jsd, micro_batches=1, accumulation_steps=2)
        trainer.run([augmix_batch(3, seed) for seed in range(4)])
    said = [r for r in caplog.records if "split check" in r.getMessage()]  # one line, no warning (no false alarm)
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    said = said[0].getMessage()
    assert "AssertionError" in said and "split_batch=fn(x, y, chunks)" in said and "not checked" in said, said
    assert "\n" not in said and trainer.state.iteration == 4
    assert trainer.amp_step.split_check.summary() == said  # and the run's summary says it
    with pytest.raises(SplitCheckError, match=r"AssertionError\): the batch cannot be cut there; pass split_batch"
                       ) as info:  # the step would cut it as the check did
        trainer_for(copy.deepcopy(model), jsd).run([augmix_batch(3)])
    one_line(info)
    cut, reference = copy.deepcopy(model), copy.deepcopy(model)
    trainer = trainer_for(cut, jsd, split_batch=by_views)
    trainer.run([augmix_batch(4)])
    hand_loop(reference, [augmix_batch(4)], lambda m, b: jsd(m(b[0]), b[1]))
    assert_same_weights(cut, reference)
    assert trainer.amp_step._split_check.last < 1e-5


# -- 9. randomness held still, or detected -----------------------------------------------------------------------
class Random(nn.Module):
    """Every kind of draw the issue found stopped as "rows interact": RReLU, normal(mean, std), normal(0, s, size),
    poisson, log_normal_, Gamma.rsample, and a NumPy and a Python draw once per forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(5, 8), nn.Linear(8, 3), nn.RReLU()

    def forward(self, x):
        import random

        import numpy

        h = self.act(self.a(x))
        h = h + torch.normal(h.detach(), 0.1) * 0.01 + torch.normal(0.0, 0.1, h.shape) + torch.poisson(h.detach().abs())
        h = h * torch.empty_like(h).log_normal_(0.0, 0.1) * torch.distributions.Gamma(h.abs() + 1, 1.0).rsample()
        return self.b(h) * (1 + numpy.random.rand() + random.random())


def test_every_random_operator_and_a_draw_per_forward_raise_no_alarm_and_change_nothing():
    import random

    import numpy

    torch.manual_seed(0)
    start = Random()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    ends = []
    for check in (True, False):
        torch.manual_seed(1), numpy.random.seed(1), random.seed(1)
        model = copy.deepcopy(start)
        trainer = trainer_for(model, F.cross_entropy, check_split=check)
        trainer.run(batches)
        ends.append((model.state_dict(), torch.get_rng_state(), numpy.random.rand(), random.random()))
        if check:
            assert trainer.amp_step._split_check.passes == REPEATS
    (ours, *draws), (theirs, *draws2) = ends
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert torch.equal(draws[0], draws2[0]) and draws[1:] == draws2[1:]


class CountsCalls(nn.Module):
    """A forward that changes its own state: a count of its calls in a buffer, and one in a Python attribute."""

    def __init__(self, in_buffer):
        super().__init__()
        self.net, self.in_buffer, self.calls = nn.Linear(5, 3), in_buffer, 0
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        self.calls += 1
        return self.net(x) * (self.seen if self.in_buffer else self.calls)


def test_state_in_buffers_is_held_still_and_state_outside_them_is_detected():
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g))
    model = CountsCalls(in_buffer=True)
    trainer = trainer_for(model, F.cross_entropy)
    trainer.run([batch] * 2)
    assert trainer.amp_step._split_check.last < 1e-5 and model.seen.item() == 4  # the step's 4 chunks, not the check's
    with pytest.raises(SplitCheckError, match="gives another gradient on the same samples at each call") as info:
        trainer_for(CountsCalls(in_buffer=False), F.cross_entropy).run([batch])
    assert "rows interact" not in one_line(info) and "num_items" not in str(info.value)


# -- 8. a forward that changes the model's state -----------------------------------------------------------------
def test_legacy_spectral_norm_is_checked_from_its_state_and_left_as_it_was():
    """torch.nn.utils.spectral_norm runs a power iteration per training forward (GAN discriminators): the check's
    forwards each start from the state the step's will, and leave weights and buffers as a run without it."""
    torch.manual_seed(0)
    start = nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 8)), nn.LeakyReLU(0.2),
                          nn.utils.spectral_norm(nn.Linear(8, 1)))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 5, generator=g), torch.rand(6, 1, generator=g)) for _ in range(4)]
    ends = []
    for check in (True, False):
        model = copy.deepcopy(start)
        trainer = trainer_for(model, F.mse_loss, check_split=check)
        trainer.run(batches)
        ends.append(model.state_dict())
        if check:
            assert trainer.amp_step._split_check.passes == REPEATS and trainer.amp_step._split_check.last < 1e-4
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[1])


# -- 6. two means in one loss ------------------------------------------------------------------------------------
def tiny_mask_rcnn():
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, padding=1), nn.ReLU())
    backbone.out_channels = 8
    return MaskRCNN(backbone, num_classes=3, min_size=32, max_size=32, image_mean=[0.5] * 3, image_std=[0.25] * 3,
                    rpn_anchor_generator=AnchorGenerator(sizes=((8, 16),), aspect_ratios=((1.0,),)),
                    box_roi_pool=MultiScaleRoIAlign(["0"], 3, 2), mask_roi_pool=MultiScaleRoIAlign(["0"], 4, 2),
                    representation_size=32, mask_layers=(8,), mask_dilation=1)


def mask_batch(objects):
    """Images of one size, ``objects[i]`` boxes and masks on image i."""
    g = torch.Generator().manual_seed(0)
    images, targets = [torch.rand(3, 32, 32, generator=g) for _ in objects], []
    for k in objects:
        masks = torch.zeros(k, 32, 32, dtype=torch.uint8)
        for j in range(k):
            masks[j, 4:24, 2 + 6 * j:14 + 6 * j] = 1
        targets.append({"boxes": torch.tensor([[2.0 + 6 * j, 4.0, 14.0 + 6 * j, 24.0] for j in range(k)]),
                        "labels": torch.ones(k, dtype=torch.long), "masks": masks})
    return images, targets


@pytest.mark.slow
def test_mask_rcnn_is_told_it_adds_means_over_different_counts_not_rows_or_sizes():
    """Its mask loss averages over the batch's positive RoIs, its other losses per image: images of one size."""
    def run(objects):
        model = tiny_mask_rcnn()
        trainer = trainer_for(model, lambda losses, y: sum(losses.values()), model_fn=lambda m, x: m(*x),
                              prepare_batch=lambda b, device, non_blocking: (tuple(b), None))
        trainer.run([mask_batch(objects)])
        return trainer

    assert run([1, 3, 1, 3]).amp_step._split_check.last < 1e-4  # each chunk holds as many objects
    with pytest.raises(SplitCheckError, match=r"adds means over different counts: .*'loss_mask' 2\d%") as info:
        run([1, 1, 3, 3])
    text = one_line(info)
    assert "rows interact" not in text and "one size" not in text


def test_a_per_sample_and_a_per_token_mean_in_one_loss_are_named_among_the_causes():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.cls, self.tok = nn.Embedding(10, 8), nn.Linear(8, 2), nn.Linear(8, 10)

        def forward(self, ids):
            h = self.embed(ids)
            return self.cls(h.mean(1)), self.tok(h)

    def multitask(out, y):
        labels, tags = y
        return F.cross_entropy(out[0], labels) + F.cross_entropy(out[1].flatten(0, 1), tags.flatten())

    g = torch.Generator().manual_seed(0)
    ids, tags = torch.randint(0, 10, (4, 6), generator=g), torch.randint(0, 10, (4, 6), generator=g)
    tags[:2, 2:] = -100  # the first chunk's tokens are fewer
    torch.manual_seed(0)
    with pytest.raises(SplitCheckError, match="adds means over different counts") as info:
        trainer_for(TwoHeads(), multitask).run([(ids, (torch.tensor([0, 1, 1, 0]), tags))])
    assert "one size" not in one_line(info)


# -- 5. the causal-LM count from the loss's behaviour ------------------------------------------------------------
def test_a_causal_lm_that_does_not_shift_its_labels_is_told_the_count_its_loss_takes():
    """BartForCausalLM (TrOCR's and XLNet's heads too) averages over labels it does not shift: the shifted count
    documented for most *ForCausalLM is stopped, and the unshifted one named and exact."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=64, d_model=16, decoder_layers=1, decoder_attention_heads=2,
                                     decoder_ffn_dim=32, encoder_layers=1, encoder_attention_heads=2,
                                     encoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0)
    model = transformers.BartForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 64, (8, 10), generator=g)
    labels = ids.clone()
    labels[4, 3:], labels[5, 8:], labels[7, 5:] = -100, -100, -100  # the first chunk unpadded, the second padded
    batch = {"input_ids": ids, "labels": labels}
    unshifted = 'num_items=lambda x, y: (x["labels"] != -100).sum() fits'
    for count in (None, lambda x, y: (x["labels"][..., 1:] != -100).sum()):
        with pytest.raises(SplitCheckError, match=re.escape(unshifted)) as info:
            trainer_for(copy.deepcopy(model), lambda out, y: out.loss, model_fn=lambda m, x: m(**x),
                        num_items=count).run([batch])
        one_line(info)
    ours, reference = copy.deepcopy(model), copy.deepcopy(model)
    trainer_for(ours, lambda out, y: out.loss, model_fn=lambda m, x: m(**x),
                num_items=lambda x, y: (x["labels"] != -100).sum()).run([batch])
    hand_loop(reference, [batch], lambda m, b: m(**b).loss)
    assert_same_weights(ours, reference)


def test_the_padding_warning_gives_no_shift_it_has_not_seen(caplog):
    """With the check off, labels a model reads itself get what to count (no lambda: the shift is the loss's)."""
    transformers = pytest.importorskip("transformers")
    from ignite_amp.step.contracts import warn_padding_without_items

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)
    with caplog.at_level(logging.WARNING, logger="ignite_amp"):
        warn_padding_without_items({"input_ids": torch.zeros(2, 4).long(), "labels": torch.tensor([[1, -100]] * 2)},
                                   None, lambda out, y: out.loss, transformers.LlamaForCausalLM(config))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "lambda" not in said[0] and "check_split=True, names the count that fits" in said[0]


def test_mixup_on_the_batch_before_the_step_is_exact_under_micro_batches_and_accumulation():
    """timm's Mixup mixes each batch with itself flipped (one draw per batch, from NumPy): done in prepare_batch,
    the step cuts the mixed batch, so its chunks and the cycle give the mixed batches' mean gradient."""
    import numpy
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    mix, soft = Mixup(mixup_alpha=1.0, num_classes=3, label_smoothing=0.0), SoftTargetCrossEntropy()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    numpy.random.seed(0)
    trainer = trainer_for(model, soft, accumulation_steps=2,
                          prepare_batch=lambda b, device, non_blocking: mix(b[0].clone(), b[1]))
    trainer.run(batches)
    assert trainer.amp_step._split_check.passes == REPEATS
    numpy.random.seed(0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):  # the hand-written accumulation: the mean of the two batches' means
        if i % 2 == 0:
            opt.zero_grad()
        mixed, targets = mix(x.clone(), y)
        (soft(reference(mixed), targets) / 2).backward()
        if i % 2 == 1:
            opt.step()
    assert_same_weights(model, reference)


def test_randomness_is_held_still_in_the_check_after_an_out_of_memory_retry():
    from ignite_amp.handlers import OOMBackoff

    class RandomOutOfMemoryAbove(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.act = nn.Linear(5, 3), nn.RReLU()

        def forward(self, x):
            if len(x) > 3:
                raise torch.OutOfMemoryError(f"CUDA out of memory: {len(x)} samples (stand-in)")
            return self.act(self.net(x)) + torch.normal(0.0, 0.1, (len(x), 3))

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    trainer = trainer_for(RandomOutOfMemoryAbove(), F.cross_entropy, micro_batches=1)
    OOMBackoff().attach(trainer)
    trainer.run(batches)  # cut at the retry, checked inside one chunk (3 samples): no alarm
    assert trainer.amp_step.micro_batches == 2 and trainer.amp_step._split_check.passes == REPEATS


def test_bfloat16_parameters_pass_at_their_own_tolerance():
    """A model kept in bfloat16 rounds its gradients to ~1e-2: judged at LOW_PRECISION_TOLERANCE, not float32's."""
    from ignite_amp.split_check.check import LOW_PRECISION_TOLERANCE, TOLERANCE

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 3)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=g).bfloat16(), torch.randint(0, 3, (32,), generator=g))
               for _ in range(REPEATS)]
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 lambda out, y: F.cross_entropy(out.float(), y), device="cpu", dtype="bfloat16",
                                 micro_batches=2)
    trainer.run(batches)
    check = trainer.amp_step._split_check
    assert check.passes == REPEATS and TOLERANCE < check.last <= LOW_PRECISION_TOLERANCE


def test_the_out_of_place_and_in_place_forms_draw_alike():
    from ignite_amp.split_check.randomness import still

    x, aten = torch.randn(4, generator=torch.Generator().manual_seed(0)), torch.ops.aten
    for name, args in (("uniform", (0.0, 2.0)), ("cauchy", (1.0, 1.0)), ("exponential", (2.0,))):
        with still(nn.Linear(2, 2)):
            out = getattr(aten, name)(x, *args)
        with still(nn.Linear(2, 2)):
            inplace = getattr(x.clone(), name + "_")(*args)
        assert torch.equal(out, inplace) and out.unique().numel() == 4, name
    with still(nn.Linear(2, 2)) as held:
        assert torch.equal(F.rrelu(x.clone(), 0.1, 0.3, training=True, inplace=True), torch.where(x >= 0, x, x * 0.2))
        assert (aten.uniform(x, 0.0, 2.0) <= 2).all() and (aten.exponential(x, 2.0) > 0).all()
    assert not held.unheld
