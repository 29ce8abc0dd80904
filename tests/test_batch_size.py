import doctest

import pytest
import torch
from torch.nn.functional import cross_entropy

import ignite_amp.batch_size
from conftest import OOMAbove
from ignite_amp.batch_size import Trial, find_batch_size, format_trials, search_batch_size
from ignite_amp.cli import main
from ignite_amp.config import load_config, write_batch_size


def limit_fits(limit, flaky_confirm=False):
    calls = []

    def fits(size, stage):
        calls.append((size, stage))
        ok = size <= limit and not (flaky_confirm and stage == "confirm" and size > 0.8 * limit)
        return Trial(size, ok, None, 0.0, stage)

    return fits, calls


def test_docstring_examples():
    assert doctest.testmod(ignite_amp.batch_size).failed == 0


@pytest.mark.parametrize("limit", [1, 5, 31, 32, 33, 100, 1000, 5000])
def test_search_finds_the_limit_within_tolerance_then_takes_the_margin(limit):
    fits, calls = limit_fits(limit)
    result = search_batch_size(fits, start=32, max_size=8192, margin=0.1, tolerance=0.03)
    assert result.largest_fit <= limit
    assert result.largest_fit >= limit * 0.97 - 1
    assert result.batch_size == max(1, int(result.largest_fit * 0.9))
    assert calls[-1] == (result.batch_size, "confirm")
    doubling = [s for s, stage in calls if stage == "double"]
    assert doubling == [32 * 2**i for i in range(len(doubling))]
    assert len(calls) <= 15  # doubling from 32 to 8192 is 9 trials; bisection to 3% 5 more; a confirm


def test_search_stops_at_max_size():
    fits, calls = limit_fits(10**9)
    result = search_batch_size(fits, start=8, max_size=100, margin=0.0)
    assert result.largest_fit == 100 and result.batch_size == 100
    assert [s for s, _ in calls] == [8, 16, 32, 64, 100, 100]


def test_failed_confirmation_shrinks_again():
    fits, calls = limit_fits(100, flaky_confirm=True)
    result = search_batch_size(fits, start=8, margin=0.1)
    confirms = [s for s, stage in calls if stage == "confirm"]
    assert len(confirms) >= 2 and result.batch_size <= 80


def test_bad_arguments():
    fits, _ = limit_fits(10)
    for kwargs, message in (({"start": 0}, "start should be"), ({"max_size": 4, "start": 8}, "max_size should be"),
                            ({"margin": 1.0}, "margin should be in")):
        with pytest.raises(ValueError, match=message):
            search_batch_size(fits, **kwargs)


def test_find_batch_size_with_a_real_step_leaves_no_trace():
    torch.manual_seed(0)
    model = OOMAbove(limit=100)
    model.bn = torch.nn.BatchNorm1d(5)  # a buffer that a forward in train mode would change
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    # Give the optimizer some state first, as in a run that is under way.
    cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    optimizer.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    rng = torch.get_rng_state()

    result = find_batch_size(model, optimizer, cross_entropy,
                             lambda n: (torch.randn(n, 5), torch.randint(0, 3, (n,))), device="cpu",
                             dtype="float16", start=8, margin=0.1)
    assert result.largest_fit >= 97 and result.batch_size == int(result.largest_fit * 0.9)
    assert any(not t.fits for t in result.trials) and result.trials[-1].stage == "confirm"
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for k, v in optimizer.state_dict()["state"][0].items():
        assert torch.equal(v, opt_state[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    table = format_trials(result)
    assert "OOM" in table and f"chosen batch size {result.batch_size}" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cli_without_cuda_says_it_needs_a_gpu(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("data: {name: shapes}\n")
    assert main(["find-batch-size", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the batch-size search needs a GPU" in err and err.count("\n") == 1
    path.write_text("data: {name: shapes, batch_size: auto}\n")
    assert main(["train", str(path), "--set", f"output_dir={tmp_path / 'out'}"]) == 2
    assert "data.batch_size: the batch-size search needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("text", [
    "# my run\ndata: {name: shapes, batch_size: 64, eval_batch_size: 128}  # keep\nmodel: {name: resnet18}\n",
    "# my run\ndata:\n  name: shapes\n  eval_batch_size: 128\n  batch_size: auto   # searched\nmodel: {name: resnet18}\n",
    "name: x\n",
])
def test_write_batch_size_keeps_comments(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    write_batch_size(str(path), 96)
    cfg = load_config(str(path))
    assert cfg["data"]["batch_size"] == 96
    if "eval_batch_size" in text:
        assert cfg["data"]["eval_batch_size"] == 128 and "# my run" in path.read_text()


@pytest.mark.gpu
def test_gpu_search_is_within_10_percent_of_the_largest_fit_and_trains():
    """Real OOMs: cap the process at a memory fraction, search, then check neighbours of the answer."""
    from torchvision.models import resnet18

    device = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(0.1, device)
    try:
        model = resnet18(num_classes=10).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def make_batch(n):
            return torch.randn(n, 3, 128, 128, device=device), torch.randint(0, 10, (n,), device=device)

        result = find_batch_size(model, optimizer, cross_entropy, make_batch, device=device, dtype="bfloat16",
                                 start=16, margin=0.05, tolerance=0.02)
        # The largest size that truly fits, probed upward from the search's own largest fit.
        probe = search_batch_size(lambda n, s: Trial(n, _trial(model, optimizer, make_batch, n), None, 0, s),
                                  start=result.largest_fit, margin=0.0, tolerance=0.01)
        assert result.batch_size >= 0.9 * probe.largest_fit
        from ignite_amp import create_amp_trainer

        trainer = create_amp_trainer(model, optimizer, cross_entropy, device=device, dtype="bfloat16")
        trainer.run([make_batch(result.batch_size) for _ in range(20)], max_epochs=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _trial(model, optimizer, make_batch, n):
    """Does batch size ``n`` train? Two real AMP steps, as the search's own trials run."""
    from ignite_amp.step import create_amp_trainer, free_memory, is_oom_error

    engine = create_amp_trainer(model, optimizer, cross_entropy, device="cuda", dtype="bfloat16")
    step = engine.amp_step
    try:
        batch = make_batch(n)
        for i in range(2):
            engine.state.iteration = i + 1
            step(engine, batch)
        return True
    except RuntimeError as exc:
        if not is_oom_error(exc):
            raise
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)
        free_memory(torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_backoff_recovers_from_real_ooms():
    from torchvision.models import resnet18

    from ignite_amp.handlers import OOMBackoff
    from ignite_amp import create_amp_trainer

    device = torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(0.05, device)
    try:
        model = resnet18(num_classes=10)
        trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cross_entropy,
                                     device=device, dtype="bfloat16")
        backoff = OOMBackoff()
        backoff.attach(trainer)
        data = [(torch.randn(512, 3, 128, 128), torch.randint(0, 10, (512,))) for _ in range(3)]
        trainer.run(data, max_epochs=1)
        assert backoff.events >= 1 and trainer.state.iteration == 3
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
