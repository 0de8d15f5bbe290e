"""Typed configuration: one schema module per config section, checks that name the full key path."""
