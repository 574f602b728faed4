"""The weight-sync role (``leafe weight-sync``, the sidecar beside each engine): consumes
``WeightsPublished`` from ``LEAFE_WEIGHTS``; produces ``/update_weights_from_disk`` calls until
every engine serves the newest.

``main`` (flags, signals), ``service`` (the reconciler).
"""
