"""The built-in configs and their JSON Schema: package data, installed as ``ignite_amp.configs``.

Read them through :mod:`ignite_amp.config.builtin` (``ignite-amp configs``, ``ignite-amp init``).
"""
