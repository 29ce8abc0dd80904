"""The split check: a batch's weighted chunks checked against the full batch's gradient, once."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "SplitCheck": "ignite_amp.split_check.check",
    "still": "ignite_amp.split_check.randomness",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
