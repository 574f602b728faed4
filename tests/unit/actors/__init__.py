"""Unit tests of actors/."""
