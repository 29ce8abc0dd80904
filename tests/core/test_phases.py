"""ignite_amp.core.phases: the step's profiler labels, present only while a profiler records."""
import torch
from torch.nn.functional import cross_entropy

from helpers import id_batches, mlp
from ignite_amp import create_amp_trainer


def test_phases_are_labelled_only_while_a_profiler_records():
    """phase_label reads torch.autograd._profiler_enabled: fails loudly if a torch upgrade changes it."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ignite_amp.core.phases import phase_label

    model = mlp()
    trainer = create_amp_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cross_entropy, device="cpu")
    assert phase_label() is not record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert phase_label() is record_function
        trainer.run(id_batches(16, 8))
    assert phase_label() is not record_function
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("ignite_amp.")}
    assert counts == {"ignite_amp.forward": 2, "ignite_amp.backward": 2, "ignite_amp.optimizer": 2}
