"""The config tree: every component's declared keys, the YAML loader, --set, the JSON Schema."""
