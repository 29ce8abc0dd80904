"""The split check on a cut whose piece has no gradient: inconclusive, not a crash (issue 54's type check)."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

from conftest import hand_loop
from ignite_amp import create_amp_trainer


def positives_only(out, y):
    """A per-sample mean over the rows with a positive target; a constant (no gradient) where there is none."""
    keep = y[:, 0] > 0
    if not keep.any():
        return torch.zeros((), device=out.device)
    return F.mse_loss(out[keep], y[keep], reduction="sum") / len(y)


def test_a_piece_whose_loss_has_no_gradient_leaves_the_check_inconclusive_and_the_step_exact():
    # Both chunks (rows 0-3, 4-7) have a positive, so the step trains; the check's second piece (rows 4-5) has
    # none: its gradients were None, and the check's comparison of them raised a TypeError out of the step.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g)
    y = torch.zeros(8, 2)
    y[[0, 6]] = 1.0
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), positives_only, device="cpu",
                                 dtype="float32", micro_batches=2, check_split=True)
    trainer.run([(x, y)])
    assert trainer.amp_step._split_check.last is None  # inconclusive: nothing measured
    assert trainer.amp_step._split_check.tries == 1
    hand_loop(reference, [(x, y)], lambda m, b: positives_only(m(b[0]), b[1]))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
