"""DevicePrefetcher (issue 51): the next batch copied to the device on a side stream while the current one computes.

CUDA's streams cannot run here: a recording stand-in of :class:`ignite_amp.data.prefetch.SideStream` (the same three
methods) logs every copy, wait and record, and the tests check their order against what the consumer does; every
reader of a loader in the project (Ignite's Engine, PassStream, OOM backoff's mode batch, validation, a config
run) is driven with and without the wrapper and must see the same batches. The real streams: the GPU test at the end.
"""
from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

import ignite_amp.data.prefetch as prefetch
from helpers import OOMAbove, assert_doctests_pass, mlp, tiny_config
from ignite_amp import create_amp_evaluator, create_amp_trainer
from ignite_amp.core.nested import map_tensors
from ignite_amp.data.datasets import make_loader
from ignite_amp.data.passes import PassStream, training_data
from ignite_amp.data.prefetch import DevicePrefetcher, device_loader
from ignite_amp.handlers import OOMBackoff
from ignite_amp.run.compose import build_run
from ignite_amp.run.fast_path import speed_words

CPU = torch.device("cpu")


class RecordingStreams:
    """The stand-in of SideStream: logs ``("copy", id)`` (from the recording prepare), ``"wait"`` and
    ``("record", tensor)``; ``side`` is true inside ``copying()``."""

    def __init__(self):
        self.log, self.side = [], False

    @contextmanager
    def copying(self):
        self.side = True
        try:
            yield
        finally:
            self.side = False

    def wait(self):
        self.log.append("wait")

    def record(self, tensor):
        self.log.append(("record", tensor))


def recording_prepare(streams):
    """A copy that logs the batch's id (its first value) and checks it runs on the side stream."""
    def prepare(batch):
        assert streams.side, "the copy ran outside the side stream"
        streams.log.append(("copy", int(batch[0].flatten()[0])))
        return map_tensors(batch, torch.clone)
    return prepare


def numbered(n, size=2):
    """``n`` batches ``(x, y)`` whose x starts with the batch's number."""
    return [(torch.full((size, 3), float(i)), torch.arange(size)) for i in range(n)]


def consume(prefetcher, streams, stop=None):
    """Iterate as a consumer, logging ``("use", id)`` when a batch is received; the batches received."""
    got = []
    for batch in prefetcher:
        streams.log.append(("use", int(batch[0].flatten()[0])))
        got.append(batch)
        if stop is not None and len(got) == stop:
            break
    return got


def test_the_docstring_example_runs():
    assert_doctests_pass(prefetch)


def test_the_next_copy_is_issued_before_a_batch_is_handed_over_and_the_consumer_waits_first():
    streams = RecordingStreams()
    got = consume(DevicePrefetcher(numbered(3), CPU, recording_prepare(streams), streams), streams)
    events = ["record" if isinstance(e, tuple) and e[0] == "record" else e for e in streams.log]
    assert events == [("copy", 0),
                      "wait", "record", "record", ("copy", 1), ("use", 0),
                      "wait", "record", "record", ("copy", 2), ("use", 1),
                      "wait", "record", "record", ("use", 2)]
    # Every tensor the consumer receives was recorded on its stream, after the wait and before its use.
    for i, batch in enumerate(got):
        use = streams.log.index(("use", i))
        recorded = [e[1] for e in streams.log[:use] if isinstance(e, tuple) and e[0] == "record"]
        assert all(any(t is r for r in recorded) for t in batch)


def test_nested_batches_keep_their_shape_and_every_tensor_is_recorded():
    Pair = namedtuple("Pair", "image mask")
    batch = {"x": Pair(torch.ones(2, 3), torch.zeros(2)), "ids": [torch.arange(2), "a", None], "n": (3, torch.ones(1))}
    streams = RecordingStreams()
    (got,) = list(DevicePrefetcher([batch], CPU, streams=streams))  # the default prepare: to_device(non_blocking)
    assert isinstance(got["x"], Pair) and got["ids"][1:] == ["a", None] and got["n"][0] == 3
    torch.testing.assert_close(got["x"].image, torch.ones(2, 3))
    recorded = [e[1] for e in streams.log if isinstance(e, tuple)]
    assert len(recorded) == 4 and all(any(t is r for r in recorded) for t in
                                      (got["x"].image, got["x"].mask, got["ids"][0], got["n"][1]))


def test_an_empty_loader_and_a_single_batch():
    streams = RecordingStreams()
    assert list(DevicePrefetcher([], CPU, recording_prepare(streams), streams)) == [] and streams.log == []
    got = consume(DevicePrefetcher(numbered(1), CPU, recording_prepare(streams), streams), streams)
    assert len(got) == 1 and streams.log[0] == ("copy", 0) and streams.log[-1] == ("use", 0)


def test_a_consumer_that_stops_early_leaves_the_next_pass_whole():
    streams = RecordingStreams()
    batches = DevicePrefetcher(numbered(5), CPU, recording_prepare(streams), streams)
    assert len(consume(batches, streams, stop=2)) == 2
    assert ("copy", 2) in streams.log  # the next batch was already on its way: dropped with the iterator
    again = consume(batches, streams)
    assert [int(x[0, 0]) for x, _ in again] == [0, 1, 2, 3, 4]


def test_off_cuda_the_batches_pass_through_unchanged():
    batches = numbered(3)
    wrapped = DevicePrefetcher(batches, CPU)
    assert not wrapped.prefetches and all(a is b for a, b in zip(wrapped, batches, strict=True))
    assert device_loader(batches, "cpu") is batches  # what a config run does off CUDA
    assert prefetch.side_stream("cpu") is None


def shuffled_loader(n=40, batch=8):
    """A shuffled loader whose order is drawn from a seeded generator: the same orders in a second one."""
    return DataLoader(TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n)), batch_size=batch,
                      shuffle=True, generator=torch.Generator().manual_seed(1))


def ids(batches):
    return [x[:, 0].long().tolist() for x, _ in batches]


def test_batches_and_their_order_equal_the_plain_loaders():
    plain = shuffled_loader()
    wrapped = DevicePrefetcher(shuffled_loader(), CPU, streams=RecordingStreams())
    for _ in range(2):  # two passes: each a new order, the same in both
        assert ids(wrapped) == ids(plain)


def test_the_loaders_attributes_are_read_through_the_wrapper():
    loader = make_loader(TensorDataset(torch.randn(20, 2), torch.arange(20)), 8, True, 0, CPU, seed=3)
    wrapped = DevicePrefetcher(loader, CPU, streams=RecordingStreams())
    assert len(wrapped) == 3 and wrapped.batch_size == 8 and wrapped.sampler is loader.sampler
    assert wrapped.dataset is loader.dataset and wrapped.drop_last is False
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


def record_ids(engine):
    seen = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch[1].tolist()))
    return seen


def test_an_engine_trains_on_the_same_batches_each_epoch_with_set_epoch():
    """training_data's set_epoch at each epoch's start: the same orders through the wrapper."""
    def run(wrap):
        loader = make_loader(TensorDataset(torch.randn(20, 2), torch.arange(20)), 8, True, 0, CPU, seed=3)
        engine = Engine(lambda e, b: None)
        seen = record_ids(engine)
        data = DevicePrefetcher(loader, CPU, streams=RecordingStreams()) if wrap else loader
        engine.run(training_data(engine, data, None), max_epochs=3)
        return seen

    plain = run(False)
    assert run(True) == plain and len(plain) == 9 and plain[:3] != plain[3:6]


def test_an_epoch_length_shorter_than_the_loader_and_a_resume():
    """Ignite continues the pass in progress at an epoch's end, and a resumed engine starts where it says."""
    def run(wrap, state=None, epochs=4):
        loader = shuffled_loader(n=40, batch=8)
        engine = Engine(lambda e, b: None)
        seen = record_ids(engine)
        data = DevicePrefetcher(loader, CPU, streams=RecordingStreams()) if wrap else loader
        if state is not None:
            engine.load_state_dict(state)
        engine.run(data, max_epochs=epochs, epoch_length=3)
        return seen

    assert run(True) == run(False)
    resumed = {"iteration": 7, "epoch_length": 3, "max_epochs": 4}  # inside the third epoch
    assert run(True, resumed) == run(False, resumed)


def test_a_pass_stream_over_the_wrapper_starts_where_the_trainer_is():
    def stream(wrap, position):
        loader = make_loader(TensorDataset(torch.randn(20, 2), torch.arange(20)), 8, True, 0, CPU, seed=3)
        data = DevicePrefetcher(loader, CPU, streams=RecordingStreams()) if wrap else loader
        batches = iter(PassStream(data, lambda: position))
        return [next(batches)[1].tolist() for _ in range(7)]

    for position in (0, 2, 4):
        assert stream(True, position) == stream(False, position)


def test_oom_backoff_mode_batch_rebuilds_the_loader_and_keeps_prefetching():
    x = torch.randn(24, 5)
    x[:, 0] = torch.arange(24, dtype=torch.float32)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (24,))), batch_size=8, shuffle=True)
    streams = RecordingStreams()
    backoff = OOMBackoff(mode="batch")
    model = OOMAbove(limit=4)  # out of memory above 4 samples
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu",
                                 dtype="float32", check_split=False)
    backoff.attach(trainer)
    seen, batch_sizes = [], []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: batch_sizes.append(e.amp_step.batch_size))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(sorted(model.seen)) or model.seen.clear())
    trainer.run(DevicePrefetcher(loader, CPU, streams=streams), max_epochs=3)
    assert seen == [list(range(24))] * 3  # every sample once per epoch, as without the wrapper
    assert batch_sizes == [8] * 3 + [4] * 6 + [4] * 6
    data = trainer.state.dataloader
    assert isinstance(data, DevicePrefetcher) and data.streams is streams and data.batch_size == 4
    assert streams.log.count("wait") == 3 + 6 + 6  # every batch, after the rebuild too, came through the streams


def test_validation_through_the_wrapper_gives_the_plain_loaders_metrics():
    x = torch.randn(24, 5, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(1))),
                        batch_size=8)
    evaluator = create_amp_evaluator(mlp(), {"accuracy": Accuracy()}, device="cpu", dtype="float32")
    plain = evaluator.run(loader).metrics["accuracy"]
    assert evaluator.run(DevicePrefetcher(loader, CPU, streams=RecordingStreams())).metrics["accuracy"] == plain


@pytest.mark.slow
def test_a_config_run_trains_the_same_losses_through_the_wrapper(tmp_path, monkeypatch):
    """A run built from a config with the prefetcher forced on (the stand-in streams, as on CUDA) trains and
    validates as the run without it: the same batches in the same order, the same figures."""
    cfg = tiny_config(tmp_path, data={"train_size": 96, "val_size": 32, "batch_size": 16}, train={"epochs": 2},
                      amp={"dtype": "float32"}, scheduler={"name": "none"})
    plain = build_run(dict(cfg, output_dir=str(tmp_path / "plain")), print_fn=lambda line: None)
    assert not isinstance(plain.train_loader, DevicePrefetcher) and not plain.facts["prefetch"]
    plain_history = plain.train()["history"]

    streams = RecordingStreams()
    monkeypatch.setattr(prefetch, "side_stream", lambda device: streams)
    lines = []
    run = build_run(dict(cfg, output_dir=str(tmp_path / "prefetched")), print_fn=lines.append)
    assert isinstance(run.train_loader, DevicePrefetcher) and isinstance(run.val_loader, DevicePrefetcher)
    assert run.facts["prefetch"] is True
    history = run.train()["history"]
    assert streams.log.count("wait") == 2 * (6 + 2)  # two epochs of 6 training and 2 validation batches
    assert next(line for line in lines if line.startswith("training ")).endswith("; prefetch to GPU")
    keys = ("epoch", "train_loss", "val_loss", "val_accuracy")
    assert [{k: r[k] for k in keys} for r in history] == [{k: r[k] for k in keys} for r in plain_history]
    for a, b in zip(run.model.state_dict().values(), plain.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_start_line_says_the_input_path_only_when_prefetching():
    facts = {"channels_last": True, "fused_optimizer": True, "num_workers": 4, "prefetch": True}
    assert speed_words(facts, "AdamW").endswith("4 loader workers, prefetch to GPU on a side stream")
    assert "prefetch" not in speed_words(dict(facts, prefetch=False), "AdamW")


def test_batches_already_cut_on_the_device_are_not_wrapped():
    # data.on_device: the batches are made on the GPU; a side-stream copy would have nothing to do
    from ignite_amp.data.datasets import TensorImageDataset
    from ignite_amp.data.device_batches import DeviceBatches

    images = torch.randint(0, 256, (8, 3, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    on_device = DeviceBatches(TensorImageDataset(images, torch.arange(8) % 2, (0.5,) * 3, (0.25,) * 3), 4)
    assert device_loader(on_device, "cuda") is on_device  # (decided before any CUDA stream is made)


@pytest.mark.gpu  # skipped without CUDA (conftest)
def test_gpu_batches_equal_the_plain_loaders_moved_to_the_device():
    """On a real GPU: the prefetched batches (pinned, side stream, record_stream) equal the plain loader's moved with
    ``.to(device)``, while a matmul on the consumer's stream keeps the GPU busy between them."""
    device = torch.device("cuda")
    Pair = namedtuple("Pair", "x y")
    data = TensorDataset(torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,)))
    loader = DataLoader(data, batch_size=64, pin_memory=True,
                        collate_fn=lambda s: Pair(*map(torch.stack, zip(*s, strict=True))))
    wrapped = device_loader(loader, device)
    assert isinstance(wrapped, DevicePrefetcher) and wrapped.prefetches
    busy = torch.randn(2048, 2048, device=device)
    for _ in range(2):
        for got, want in zip(wrapped, loader, strict=True):
            assert isinstance(got, Pair) and got.x.device.type == "cuda"
            busy = busy @ busy / busy.norm()  # consumer-stream work queued while the next copy runs
            torch.testing.assert_close(got.x, want.x.to(device), rtol=0, atol=0)
            torch.testing.assert_close(got.y, want.y.to(device), rtol=0, atol=0)
    torch.cuda.synchronize()
