"""Tests of the hand-off parameter structs and the protocol registry."""
