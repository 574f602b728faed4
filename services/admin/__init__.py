"""The NATS admin role (deploy's ``leafe-streams`` and tasks Jobs, ``leafe nats``): consumes the
admin credentials; produces the streams, a run's durable consumers and its task assignments on
``LEAFE_TASKS``.

``streams`` (``leafe streams``), ``tasks`` (``leafe tasks``), ``nats`` (a local nats-server or
cluster).
"""
