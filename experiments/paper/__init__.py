"""The paper table (``experiments/paper_table.py``): Base, Base + SFT, Early Experience, GRPO, RFT,
LEAFE (model and oracle reflections), L_reh, with paired intervals and verdicts.

Modules:

- ``config``: ``PaperConfig`` (one TOML per scale: ``experiments/configs/paper_<scale>.toml``)
- ``phases``: the protocol as data: phases, references, dependencies, priority order
- ``select``: the choices made on validation (SFT candidate, GRPO lr and round)
- ``steps``: what each kind of phase does
- ``lib``: collection, evaluation, log export through the real services
- ``children``: ``leafe replay`` / ``leafe train`` subprocesses, dataset filtering
- ``runner``: protocol registration, the skeleton report, the resumable, time-boxed walk
- ``report``, ``report_tables``: the report (md, json, png)
- ``estimate``: unit costs of a finished run and the estimate of another plan
"""
