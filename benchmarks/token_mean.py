"""How far a padded token-mean loss trained in pieces is from one full batch, with and without num_items.

A causal-LM-style model (embedding, tanh, linear head; labels -100 are padding) on a
length-sorted batch of 16 sequences, float32. For each split (micro-batches x accumulation
steps, and the same under 2-process gloo DDP) it prints the largest relative difference from
the full batch of (a) the gradient the optimizer sees and (b) the weights after one SGD step.

    python benchmarks/token_mean.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_hooks import TinyLM, iterations, lm_model_fn, padded_batch, tokens  # noqa: E402

from ignite_amp import AmpEvents, create_amp_trainer, load_config  # noqa: E402
from ignite_amp.launcher import launch  # noqa: E402

LR = 0.5


def full_batch(batch: dict):
    model = TinyLM()
    lm_model_fn(model, batch)["loss"].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [(p - LR * p.grad).detach() for p in model.parameters()]
    return grads, weights


def trained(batches: list, micro_batches: int, accumulation_steps: int, weigh_items: bool, ddp: bool = False):
    model = TinyLM()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=LR), lambda out, y: out["loss"],
                                 device="cpu", dtype="float32", model_fn=lm_model_fn, micro_batches=micro_batches,
                                 accumulation_steps=accumulation_steps, num_items=tokens if weigh_items else None)
    grads = []
    trainer.add_event_handler(AmpEvents.GRADS_READY,
                              lambda e: grads.append([p.grad.clone() for p in model.parameters()]))
    trainer.run(batches, max_epochs=1)
    return grads[0], [p.detach().clone() for p in model.parameters()]


def on_rank(args):
    import ignite.distributed as idist

    batches, micro_batches, accumulation_steps, weigh_items = args
    rank = idist.get_rank()
    return trained([{k: v[rank::2] for k, v in b.items()} for b in batches], micro_batches, accumulation_steps,
                   weigh_items, ddp=True)


def rel(got: list, want: list) -> float:
    return max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want, strict=True))


def main() -> None:
    batch = padded_batch(n=16)
    want_grads, want_weights = full_batch(batch)
    print("| split | processes | weighting | max rel. gradient diff | max rel. weight-update diff |")
    print("|---|---|---|---|---|")
    start = [p.detach().clone() for p in TinyLM().parameters()]
    want_update = [w - s for w, s in zip(want_weights, start, strict=True)]
    for micro, acc in ((2, 1), (1, 2), (2, 2), (4, 2)):
        for weigh in (False, True):
            grads, weights = trained(iterations(batch, acc), micro, acc, weigh)
            update = [w - s for w, s in zip(weights, start, strict=True)]
            print(f"| {micro} micro x {acc} acc | 1 | {'num_items' if weigh else 'samples'} | "
                  f"{rel(grads, want_grads):.2e} | {rel(update, want_update):.2e} |")
    cfg = load_config({"device": "cpu", "distributed": {"nproc_per_node": 2}})
    for weigh in (False, True):
        grads, weights = launch(cfg, on_rank, (iterations(batch, 2), 2, 2, weigh))
        update = [w - s for w, s in zip(weights, start, strict=True)]
        print(f"| 2 micro x 2 acc | 2 (gloo DDP) | {'num_items' if weigh else 'samples'} | "
              f"{rel(grads, want_grads):.2e} | {rel(update, want_update):.2e} |")


if __name__ == "__main__":
    main()
