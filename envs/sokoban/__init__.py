"""Sokoban: the environment (``env``), its seeded room generator (``generator``), the optimal solver
(``solver``) and the expert built on it (``expert``: demonstrations and the reflection oracle)."""
