"""The learner role (``leafe learner``, deploy's ``learner``; offline ``leafe train``): consumes
samples from ``LEAFE_SAMPLES`` or dataset shards; produces checkpoints, weight versions and
``WeightsPublished``.

``main`` (flags, ranks, signals), ``service`` (buffer, steps, checkpoints, pushes), ``train``
(offline).
"""
