"""ignite_amp.batching and ignite_amp.core.nested: batch size, chunks and their joins at any nesting, prepare_batch."""
import dataclasses
from collections import namedtuple

import pytest
import torch

from ignite_amp.batching import batch_size_of, chunk_sizes, prepare_batch, split_batch, split_pairs
from ignite_amp.core.nested import detach, join_chunks, to_channels_last, to_float32
from ignite_amp.errors import BatchError


def xs(parts):
    return [x for x, _ in parts]


def test_chunk_sizes_match_tensor_split():
    for n in (1, 5, 8, 13):
        for chunks in range(1, n + 1):
            assert chunk_sizes(n, chunks) == [len(p) for p in torch.tensor_split(torch.arange(n), chunks)]


def test_split_keeps_structure_and_per_sample_lists_aligned():
    ids = torch.arange(5)
    batch = {"input_ids": ids[:, None].repeat(1, 3), "text": [f"s{i}" for i in range(5)], "task": "lm",
             "pair": (ids.float(), [i * 10 for i in range(5)]), "scale": torch.tensor(2.0)}
    parts = xs(split_batch(batch, None, 2))
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert [p["text"] for p in parts] == [["s0", "s1", "s2"], ["s3", "s4"]]  # one string per sample, aligned
    assert [p["pair"][1] for p in parts] == [[0, 10, 20], [30, 40]]
    assert all(p["task"] == "lm" and p["scale"].item() == 2.0 for p in parts)  # not per sample: to every chunk
    assert isinstance(parts[0]["pair"], tuple)


def test_split_keeps_namedtuples_and_views():
    Pair = namedtuple("Pair", "x y")
    x = torch.randn(6, 2)
    parts = xs(split_batch(Pair(x, torch.arange(6)), None, 3))
    assert all(isinstance(p, Pair) for p in parts) and parts[2].y.tolist() == [4, 5]
    assert parts[0].x.data_ptr() == x.data_ptr()  # a view, not a copy


def test_join_is_the_inverse_of_split_at_any_nesting():
    out = {"logits": torch.randn(7, 4), "aux": [torch.randn(7), {"h": torch.randn(7, 2)}], "names": list("abcdefg"),
           "loss": torch.tensor(0.0), "none": None}
    sizes = chunk_sizes(7, 3)
    parts = xs(split_batch(out, None, 3))
    for i, p in enumerate(parts):
        p["loss"] = torch.tensor(float(i))  # a chunk's own mean: joined as the sample-weighted mean
    joined = join_chunks(parts, sizes)
    assert torch.equal(joined["logits"], out["logits"]) and torch.equal(joined["aux"][1]["h"], out["aux"][1]["h"])
    assert joined["names"] == list("abcdefg") and joined["none"] is None
    assert joined["loss"].item() == pytest.approx((0 * 3 + 1 * 2 + 2 * 2) / 7)


def test_float32_and_channels_last_at_any_nesting():
    value = {"a": torch.ones(2, dtype=torch.float16), "b": [torch.ones(2, dtype=torch.bfloat16), torch.ones(2).long()],
             "c": torch.ones(2, dtype=torch.float64)}
    out = to_float32(value)
    assert out["a"].dtype == out["b"][0].dtype == torch.float32
    assert out["b"][1].dtype == torch.int64 and out["c"].dtype == torch.float64
    images = (torch.randn(2, 3, 4, 4), {"mask": torch.randn(2, 1, 4, 4), "ids": torch.ones(2, 3, 4, 4).long()})
    last = to_channels_last(images)
    assert last[0].is_contiguous(memory_format=torch.channels_last)
    assert last[1]["mask"].stride() == torch.randn(2, 1, 4, 4).contiguous(memory_format=torch.channels_last).stride()
    assert last[1]["ids"].is_contiguous()  # integer tensors are not images


def test_prepare_batch_takes_pairs_and_mappings_and_names_anything_else():
    x, y = prepare_batch((torch.ones(2), torch.zeros(2)), torch.device("cpu"))
    assert torch.equal(x, torch.ones(2)) and torch.equal(y, torch.zeros(2))
    x, y = prepare_batch({"input_ids": torch.ones(2, 3), "text": ["a", "b"]}, torch.device("cpu"))
    assert y is None and x["text"] == ["a", "b"]
    with pytest.raises(ValueError, match=r"default prepare_batch takes \(x, y\) pairs or a mapping.*tuple of 3"):
        prepare_batch((torch.ones(2), torch.ones(2), torch.ones(2)), torch.device("cpu"))


def test_batch_size_skips_scalars():
    assert batch_size_of({"scale": torch.tensor(1.0), "x": torch.ones(4, 2)}) == 4
    assert batch_size_of(["a", "b"]) == 2  # one string per sample
    with pytest.raises(BatchError, match="cannot tell its number of samples .*batch_size=fn"):
        batch_size_of([1.0, 2.0])  # numbers may be settings: they tell nothing


def test_split_batch_keeps_structure():
    x, y = torch.arange(10), torch.arange(10) * 2
    parts = xs(split_batch((x, {"y": y}), None, 3))
    assert [len(p[0]) for p in parts] == [4, 3, 3]
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), y)


def detection_batch(n, sizes=((3, 20, 24), (3, 16, 16), (3, 24, 20), (3, 18, 18))):
    images = [torch.randn(*sizes[i % len(sizes)]) for i in range(n)]
    targets = [{"boxes": torch.rand(i % 3 + 1, 4), "labels": torch.ones(i % 3 + 1, dtype=torch.long)} for i in range(n)]
    return images, targets


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_per_sample_lists_of_images_are_counted_and_cut_by_sample(n):
    """torchvision detection: a list of 3xHxW images and a list of target dicts (3 images of 3 channels too)."""
    images, targets = detection_batch(n)
    assert batch_size_of(images, targets) == n == batch_size_of((images, targets), None)
    for x, y in ((images, targets), ((images, targets), None)):
        parts = split_batch(x, y, 2)
        firsts = [p[0] if y is not None else p[0][0] for p in parts]
        assert [len(f) for f in firsts] == [len(range(n)[:(n + 1) // 2]), n // 2]
        assert all(img.shape[0] == 3 for f in firsts for img in f)  # images whole, never cut along channels
        joined = [img for f in firsts for img in f]
        assert all(a is b for a, b in zip(joined, images, strict=True))


def test_tuple_of_batched_inputs_stays_fields_also_when_its_length_is_the_batch():
    x, y = (torch.randn(2, 4), torch.randn(2, 3)), torch.arange(2)
    parts = split_batch(x, y, 2)
    assert [(p[0][0].shape, p[0][1].shape) for p in parts] == [((1, 4), (1, 3))] * 2


def test_disagreeing_tensors_are_one_line_naming_them_and_the_hook():
    graph = {"x": torch.randn(113, 3), "edge_index": torch.zeros(2, 50, dtype=torch.long), "batch": torch.zeros(113)}
    with pytest.raises(BatchError, match=r"x\['x'\] has 113, x\['edge_index'\] has 2, x\['batch'\] has 113\): "
                                         r".*batch_size=fn"):
        batch_size_of(graph, torch.zeros(16))
    with pytest.raises(BatchError, match=r"x and y disagree .*\(x has 113 rows, y 16\)"):
        batch_size_of(graph["x"], torch.zeros(16))  # nodes beside graph labels: fewer targets than rows
    assert batch_size_of(torch.zeros(4, 16), torch.zeros(64)) == 4  # flattened per-token targets: 16 per sample
    with pytest.raises(BatchError, match=r"x\['input_ids'\] has 0, x\['labels'\] has 8"):  # issue 32, case 17
        batch_size_of({"input_ids": torch.zeros(0, 4), "labels": torch.zeros(8)})
    assert batch_size_of({"ids": torch.ones(4, 3), "position_ids": torch.arange(3)[None]}) == 4  # 1: broadcast


@dataclasses.dataclass
class Batch:
    pixels: torch.Tensor
    labels: torch.Tensor
    source: str = "train"


def test_dataclass_batches_are_counted_and_cut_field_by_field():
    batch = Batch(torch.randn(5, 2), torch.arange(5))
    assert batch_size_of(batch, None) == 5
    parts = xs(split_batch(batch, None, 2))
    assert all(isinstance(p, Batch) and p.source == "train" for p in parts)
    assert [p.labels.tolist() for p in parts] == [[0, 1, 2], [3, 4]]


class GraphBatch:
    """Like PyTorch Geometric's Batch: nodes of all graphs stacked, moved with .to()."""

    def __init__(self, nodes):
        self.x = torch.randn(nodes, 3)

    def to(self, device):
        return self


def test_an_object_that_holds_tensors_is_sized_by_y_and_not_cut_silently():
    assert batch_size_of(GraphBatch(40), torch.zeros(6)) == 6
    with pytest.raises(BatchError, match=r"cannot cut x \(a GraphBatch\).*split_batch=fn\(x, y, chunks\)"):
        split_batch(GraphBatch(40), torch.zeros(6), 2)
    with pytest.raises(BatchError, match=r"cannot cut x\['ids'\] \(3 rows\) into micro-batches of a batch of 4"):
        split_pairs({"ids": torch.zeros(3, 2)}, None, 4, 2)  # 4 samples by a user's batch_size hook


class Cache:
    """Like Hugging Face's DynamicCache: an object in a model's outputs."""


def test_unknown_leaves_pass_through_detach_float32_and_join():
    cache = Cache()
    out = {"logits": torch.ones(2, 3, dtype=torch.bfloat16, requires_grad=True), "past_key_values": cache,
           "n": 3, "meta": None, "note": "x"}
    got = to_float32(detach(out))
    assert got["past_key_values"] is cache and got["logits"].dtype == torch.float32 and not got["logits"].requires_grad
    other = dict(got, past_key_values=Cache())
    joined = join_chunks([got, other], [2, 2])
    assert joined["past_key_values"] == [cache, other["past_key_values"]]  # each chunk's, in order
    assert joined["n"] == 3 and joined["meta"] is None and joined["note"] == "x" and joined["logits"].shape == (4, 3)


def test_prepare_batch_keeps_non_tensor_fields_and_moves_objects_with_to():
    """Issue 32, case 16: ints, floats, None and ragged lists in a dict batch are kept."""
    batch = {"ids": torch.ones(2, 3), "epoch": 1, "scale": 0.5, "extra": None, "ragged": [[1, 2], [3]]}
    x, y = prepare_batch(batch, torch.device("cpu"))
    assert y is None and x["epoch"] == 1 and x["scale"] == 0.5 and x["extra"] is None and x["ragged"] == [[1, 2], [3]]
    moved = []

    class Movable:
        def to(self, device):
            moved.append(device)
            return self

    prepare_batch((Movable(), torch.zeros(2)), torch.device("cpu"))
    assert moved == [torch.device("cpu")]


def test_output_tuples_stay_tuples_whatever_the_chunk_size():
    """Found by an adversarial pass: (logits, None) from chunks of 2 samples was taken as 2 per-sample items."""
    parts = [(torch.randn(2, 3), None), (torch.randn(2, 3), None)]
    joined = join_chunks(parts, [2, 2])
    assert isinstance(joined, tuple) and len(joined) == 2 and joined[0].shape == (4, 3) and joined[1] is None
    aux = join_chunks([(torch.randn(2, 3), torch.tensor(1.0)), (torch.randn(2, 3), torch.tensor(3.0))], [2, 2])
    assert aux[0].shape == (4, 3) and aux[1].item() == 2.0
    boxes = join_chunks([[{"b": 1}, {"b": 2}], [{"b": 3}]], [2, 1])  # detection's per-sample dicts
    assert boxes == [{"b": 1}, {"b": 2}, {"b": 3}]


def test_a_chunks_own_mean_loss_joins_by_the_items_counted():
    parts = [{"loss": torch.tensor(2.0)}, {"loss": torch.tensor(float("nan"))}, {"loss": torch.tensor(5.0)}]
    joined = join_chunks(parts, [2, 2, 2], weights=[torch.tensor(3.0), torch.tensor(0.0), torch.tensor(1.0)])
    assert joined["loss"].item() == pytest.approx((2.0 * 3 + 5.0) / 4)  # the padding-only chunk adds nothing


def test_sequence_first_inputs_are_not_guessed():
    assert batch_size_of(torch.zeros(4, 16), torch.zeros(64)) == 4  # (n, T) tokens, n*T flattened targets
    with pytest.raises(BatchError, match=r"x and y disagree .*\(x has 4 rows, y 8\)"):
        batch_size_of(torch.zeros(4, 8, 3), torch.zeros(8))  # an LSTM's (T, n, F) beside n labels
