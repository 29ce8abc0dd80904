"""The built-in configs and their JSON Schema: package data, installed as ``ignite_amp.configs``.

Read them through :mod:`ignite_amp.builtin_configs` (``ignite-amp configs``, ``ignite-amp init``).
"""
