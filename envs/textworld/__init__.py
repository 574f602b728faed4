"""TextWorld cooking games: the environment (``env``) and the offline game generator
(``generator``)."""
