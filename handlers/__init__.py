"""Pluggable Ignite handlers for ignite-amp trainers, one per module."""

__all__ = []
