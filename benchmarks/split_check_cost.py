"""The split check's cost on the first step (issue 37): the step that checks against the same step with
``check_split=False``, interleaved, from the same weights and batch; and the extra peak memory on a GPU.

    python benchmarks/split_check_cost.py          # CPU (or the GPU when there is one): prints the table
    python benchmarks/gpu_suite.py --only l        # the GPU suite's opt-in section l

The check runs on the first three batches that are cut (and again when the micro-batch count changes), until
it has three conclusive verdicts: forward and backward passes of half of each of the step's first two chunks in
float32, about one step's compute each (issue 49). Later steps cost nothing more.
"""
import argparse
import gc
import statistics
import time

import torch
from float8_gpt import GPT, next_token_loss

from ignite_amp import create_amp_trainer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_steps(size: dict, check: bool, device: torch.device, initial: dict, batch: tuple) -> dict:
    """The first step's and the second step's milliseconds, and the peak memory of the first (CUDA only)."""
    gc.collect()
    model = GPT(size["vocab"], size["width"], size["depth"], size["heads"], size["seq"]).to(device)
    model.load_state_dict(initial)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), next_token_loss, device=device,
                                 dtype=size["dtype"], micro_batches=2, check_split=check)
    cuda = device.type == "cuda"
    times = []
    for step in range(2):
        _sync(device)
        if cuda and step == 0:
            torch.cuda.reset_peak_memory_stats(device)
        begin = time.perf_counter()
        trainer.run([batch], max_epochs=1)
        _sync(device)
        times.append((time.perf_counter() - begin) * 1e3)
        if step == 0:
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    return {"first_ms": times[0], "second_ms": times[1], "peak_mb": peak,
            "checked": trainer.amp_step._split_check.last is not None}


def measure(size: dict, device: torch.device, repeats: int) -> dict:
    """Medians over ``repeats`` interleaved pairs (check on, check off)."""
    torch.manual_seed(0)
    initial = GPT(size["vocab"], size["width"], size["depth"], size["heads"], size["seq"]).state_dict()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
    batch = (data[:, :-1].to(device), data[:, 1:].to(device))
    runs = {True: [], False: []}
    first_steps(size, False, device, initial, batch)  # warm-up: kernels, allocator
    for _ in range(repeats):
        for check in (True, False):
            runs[check].append(first_steps(size, check, device, initial, batch))
    out = {}
    for check, rs in runs.items():
        out[check] = {k: statistics.median(r[k] for r in rs) for k in ("first_ms", "second_ms")}
        out[check]["peak_mb"] = rs[0]["peak_mb"]
        out[check]["checked"] = rs[0]["checked"]
    return out


GPU = dict(vocab=32768, width=1024, depth=8, heads=16, seq=1024, batch=16, dtype="bfloat16", repeats=3)
SMOKE = dict(vocab=256, width=64, depth=2, heads=4, seq=32, batch=8, dtype="bfloat16", repeats=1)


def split_check_section(ctx) -> None:
    """The GPU suite's section l: the first step with and without the split check."""
    size = ctx.sizes(gpu=GPU, smoke=SMOKE)
    ctx.result["data"]["sizes"] = size
    ctx.table(f"GPT {size['depth']} x {size['width']}, sequence {size['seq']}, batch {size['batch']}, "
              f"{size['dtype']}, micro_batches=2 (medians of {size['repeats']} interleaved pairs)",
              ["check_split", "first_step_ms", "second_step_ms", "peak_mb", "checked", "status"])
    measured = measure(size, ctx.device, size["repeats"])
    for check in (True, False):
        m = measured[check]
        ctx.row(check_split=check, first_step_ms=m["first_ms"], second_step_ms=m["second_ms"], peak_mb=m["peak_mb"],
                checked=m["checked"], status="measured")
    on, off = measured[True], measured[False]
    extra_ms = on["first_ms"] - off["first_ms"]
    extra_mb = None if on["peak_mb"] is None else on["peak_mb"] - off["peak_mb"]
    value = f"+{extra_ms:.0f} ms on the first step" + ("" if extra_mb is None else f", +{extra_mb:.0f} MB peak")
    ctx.target("split check: at most one step's time on the first step (no target; measured)",
               value, None if extra_mb is None else extra_ms <= off["first_ms"])
    ctx.note("The second step checks again (the check runs on the first three cut batches, issue 49); steps after "
             "the third do not. Without CUDA there is no memory figure.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny sizes")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SMOKE if args.smoke or device.type == "cpu" else GPU
    measured = measure(size, device, size["repeats"])
    print(f"device {device}, torch {torch.__version__}, sizes {size}")
    for check, m in measured.items():
        print(f"check_split={check}: first step {m['first_ms']:.1f} ms, second {m['second_ms']:.1f} ms, "
              f"peak {m['peak_mb'] if m['peak_mb'] is None else round(m['peak_mb'], 1)} MB, checked {m['checked']}")


if __name__ == "__main__":
    main()
