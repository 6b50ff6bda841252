"""Speculative decoding: draft trees, verification, the decode engine."""
