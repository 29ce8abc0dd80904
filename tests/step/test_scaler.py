"""ignite_amp.step.scaler: the private GradScaler reads break loudly if torch changes them."""
import pytest
import torch
from torch.nn.functional import cross_entropy

from helpers import id_batches, mlp
from ignite_amp import create_amp_trainer


def test_found_inf_reads_the_flag_unscale_recorded():
    """The one read of GradScaler's private state: fails loudly if a torch upgrade moves it."""
    from ignite_amp.step.scaler import found_inf

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with pytest.raises(RuntimeError, match="no inf/NaN check"):
        found_inf(scaler, opt)
    (x, y), = id_batches(8, 8)
    for bad in (False, True):
        opt.zero_grad()
        scaler.scale(cross_entropy(model(x * (float("inf") if bad else 1.0)), y)).backward()
        scaler.unscale_(opt)
        flag = found_inf(scaler, opt)
        assert torch.is_tensor(flag) and flag.numel() == 1 and bool(flag.item()) is bad
        scaler.update()


def test_scale_tensor_is_the_scalers_scale_without_a_sync():
    """Breaks loudly if torch renames GradScaler's private accessor."""
    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float16", scaler_kwargs={"init_scale": 1024.0})
    trainer.run(id_batches(8, 8), max_epochs=1)
    from ignite_amp.step.scaler import scale_tensor

    scale = scale_tensor(trainer.amp_step.scaler)
    assert torch.is_tensor(scale) and scale.item() == trainer.amp_step.scaler.get_scale() == 1024.0
