"""The config tree: every component's declared keys, the YAML loader, --set, the JSON Schema."""
from ignite_amp.core.exports import lazy_exports

_EXPORTS = {
    "load_config": "ignite_amp.config.tree",
    "default_config": "ignite_amp.config.tree",
    "config_schema": "ignite_amp.config.tree",
    "Config": "ignite_amp.config.tree",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
