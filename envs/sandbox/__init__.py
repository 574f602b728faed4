"""Running untrusted code: ``launch`` is the entry point (probe what isolation this host supports,
run or open a sandboxed Python), ``plan`` says what the boot stage builds, ``boot`` builds it from
inside the new namespaces (stdlib only, run as a file) and ``process`` starts, talks to and cleans
up one run."""
