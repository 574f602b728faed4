"""The evaluation role (``leafe eval``): consumes models or weight versions and a split's tasks;
produces Pass@k (``eval.json``, ``eval.md``, ``passk.png``, TensorBoard scalars) and, with
``--nats``, eval events.

``main`` (servers, rollouts, files), ``progress`` (progress lines), ``scalars`` (TensorBoard).
"""
