"""The step: one batch in the AMP order (training and evaluation), its events, chunks, scaler and grad norm."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "AmpStep": "ignite_amp.step.train",
    "EvalStep": "ignite_amp.step.evaluate",
    "AmpEvents": "ignite_amp.step.events",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
