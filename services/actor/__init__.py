"""The actor role (``leafe actor``, deploy's ``actor`` StatefulSet): consumes task assignments from
``LEAFE_TASKS`` and generates through an inference engine; produces the episode events on
``LEAFE_EVENTS``.

``main`` (flags, config, signals), ``service`` (the work queue, acks, drain), ``episode`` (one task:
explorer, demonstration or rollout, publishing, keepalives).
"""
