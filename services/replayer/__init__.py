"""The replayer role (``leafe replayer``, deploy's ``replayer``; offline ``leafe replay``): consumes
the event log (``LEAFE_EVENTS`` or a ``.leafelog`` file); produces samples on ``LEAFE_SAMPLES`` or
dataset shards.

``main`` and ``service`` (the online replayer: admission, anchors, recovery, dead letters),
``config``, ``sample_sink`` (storing its samples), ``redrive`` (``leafe replayer redrive``),
``replay`` (offline).
"""
