"""ignite_amp.batching: batch size, chunks and their joins at any nesting, the default prepare_batch."""
from collections import namedtuple

import pytest
import torch

from ignite_amp.batching import (batch_size_of, chunk_sizes, join_chunks, prepare_batch, split_batch, to_channels_last,
                                 to_float32)


def test_chunk_sizes_match_tensor_split():
    for n in (1, 5, 8, 13):
        for chunks in range(1, n + 1):
            assert chunk_sizes(n, chunks) == [len(p) for p in torch.tensor_split(torch.arange(n), chunks)]


def test_split_keeps_structure_and_per_sample_lists_aligned():
    ids = torch.arange(5)
    batch = {"input_ids": ids[:, None].repeat(1, 3), "text": [f"s{i}" for i in range(5)], "task": "lm",
             "pair": (ids.float(), [i * 10 for i in range(5)]), "scale": torch.tensor(2.0)}
    parts = split_batch(batch, 2)
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert [p["text"] for p in parts] == [["s0", "s1", "s2"], ["s3", "s4"]]  # one string per sample, aligned
    assert [p["pair"][1] for p in parts] == [[0, 10, 20], [30, 40]]
    assert all(p["task"] == "lm" and p["scale"].item() == 2.0 for p in parts)  # not per sample: to every chunk
    assert isinstance(parts[0]["pair"], tuple)


def test_split_keeps_namedtuples_and_views():
    Pair = namedtuple("Pair", "x y")
    x = torch.randn(6, 2)
    parts = split_batch(Pair(x, torch.arange(6)), 3)
    assert all(isinstance(p, Pair) for p in parts) and parts[2].y.tolist() == [4, 5]
    assert parts[0].x.data_ptr() == x.data_ptr()  # a view, not a copy


def test_join_is_the_inverse_of_split_at_any_nesting():
    out = {"logits": torch.randn(7, 4), "aux": [torch.randn(7), {"h": torch.randn(7, 2)}], "names": list("abcdefg"),
           "loss": torch.tensor(0.0), "none": None}
    sizes = chunk_sizes(7, 3)
    parts = split_batch(out, 3)
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
    with pytest.raises(TypeError, match="cannot find a tensor"):
        batch_size_of(["a", "b"])


def test_split_batch_keeps_structure():
    x, y = torch.arange(10), torch.arange(10) * 2
    parts = split_batch((x, {"y": y}), 3)
    assert [len(p[0]) for p in parts] == [4, 3, 3]
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), y)
