"""HumanEval coding: the environment (``env``), its problems (``problems``), the judge that runs a
submission in the sandbox and gives the verdict from outside it (``judge``), the submission's side
of that exchange (``harness``, run inside the sandbox) and the expert (``expert``)."""
